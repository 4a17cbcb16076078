# Sourced by ops/test: make sure Debian's `chromium` is there for the browser tests
# (tests/e2e/test_report_browser.py, tests/e2e/test_dashboard_browser.py), and Debian's
# `prometheus` for the scrape test; see ops/debian_tools.sh for when they are installed.
# shellcheck source=ops/debian_tools.sh
source "$(dirname "${BASH_SOURCE[0]}")/debian_tools.sh"

ensure_chromium() {
    ensure_debian_tool /usr/bin/chromium chromium "the browser tests"
}
