# Sourced by ops/test (through ops/browser.sh): make sure a Debian package's binary is there for
# the tests that need it. It installs only when the binary is missing, apt-get exists and we are
# root; anything else, or a failed install, is only a warning: those tests then skip with a reason.
# Never fatal, so it is safe under `set -euo pipefail`. apt-get update runs at most once per run.

_tollway_apt_updated=""

ensure_debian_tool() {
    local binary="$1" package="$2" tests="$3"
    if [ -x "$binary" ]; then
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "warning: $binary is missing and there is no apt-get: $tests will skip" >&2
        return 0
    fi
    if [ "$(id -u)" != "0" ]; then
        echo "warning: $binary is missing (run 'apt-get install $package' as root): $tests will skip" >&2
        return 0
    fi
    echo "Installing $package for $tests (first run only)…" >&2
    if [ -z "$_tollway_apt_updated" ]; then
        DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update -q >/dev/null || true
        _tollway_apt_updated=1
    fi
    if ! DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends "$package" >/dev/null; then
        echo "warning: installing $package failed: $tests will skip" >&2
    fi
    return 0
}

ensure_prometheus() {
    ensure_debian_tool /usr/bin/prometheus prometheus "the Prometheus scrape test (tests/e2e/test_prometheus_scrape.py)"
}
