# Sourced by ops/test: make sure Debian's `chromium` is there for the browser tests
# (tests/e2e/test_report_browser.py). It installs only when /usr/bin/chromium is missing, apt-get
# exists and we are root; anything else, or a failed install, is only a warning: the browser tests
# then skip with a reason. Never fatal, so it is safe under `set -euo pipefail`.

ensure_chromium() {
    local chromium="/usr/bin/chromium"
    if [ -x "$chromium" ]; then
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "warning: $chromium is missing and there is no apt-get: the browser tests will skip" >&2
        return 0
    fi
    if [ "$(id -u)" != "0" ]; then
        echo "warning: $chromium is missing (run 'apt-get install chromium' as root): the browser tests will skip" >&2
        return 0
    fi
    echo "Installing chromium for the browser tests (first run only)…" >&2
    if ! { DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update -q >/dev/null \
           && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends chromium >/dev/null; }; then
        echo "warning: installing chromium failed: the browser tests will skip" >&2
    fi
    return 0
}
