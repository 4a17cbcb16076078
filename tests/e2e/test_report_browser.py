"""The HTML usage report in a real browser: Debian's headless Chromium renders the chart.

The report of a fixture database is written to a file and opened with `file://` (offline: it must
need nothing else). The screenshot and the page are kept under tests/artifacts/ for a human to look
at; the test decodes the PNG with the stdlib only and checks the chart's colours are on screen, and
checks the DOM Chromium built has one `rect.bar` per day with usage. Skips when Chromium is absent
(ops/test installs it where it can: ops/browser.sh).
"""

from __future__ import annotations

import os
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.report_render import COLOURS, to_html
from accounting.reports import usage_report
from tests.conftest import REPO_ROOT
from tests.required import require_executable
from tests.unit.accounting.test_billing import MONTH, seed

CHROMIUM = Path(os.environ.get("TOLLWAY_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = REPO_ROOT / "tests" / "artifacts"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--hide-scrollbars", "--force-device-scale-factor=1", "--window-size=1200,900")



@pytest.fixture(autouse=True)
def chromium_present() -> None:
    require_executable(CHROMIUM, "install Debian's chromium (ops/test does, as root) to run the browser tests")


def chromium(tmp_path: Path, page: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    return subprocess.run([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *extra, page.as_uri()],
                          capture_output=True, text=True, timeout=120, check=False)


class BarCounter(HTMLParser):
    """Counts `rect.bar` inside `svg#usage-chart` and reads the page title."""

    def __init__(self) -> None:
        super().__init__()
        self.in_chart = False
        self.bars: list[str] = []
        self.title, self._in_title = "", False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "svg" and attributes.get("id") == "usage-chart":
            self.in_chart = True
        elif tag == "rect" and self.in_chart and "bar" in (attributes.get("class") or "").split():
            self.bars.append(attributes.get("data-day") or "")
        self._in_title = tag == "title" and not self.in_chart

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.in_chart = False
        self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB or RGBA PNG, decoded with zlib only."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    offset, idat, header = 8, b"", b""
    while offset < len(data):
        (length,), kind = struct.unpack(">I", data[offset:offset + 4]), data[offset + 4:offset + 8]
        chunk = data[offset + 8:offset + 8 + length]
        header, idat = (chunk, idat) if kind == b"IHDR" else (header, idat + chunk if kind == b"IDAT" else idat)
        offset += 12 + length
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or colour_type not in (2, 6) or interlace:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour_type}, interlace {interlace}")
    channels = 3 if colour_type == 2 else 4
    stride, raw = width * channels, zlib.decompress(idat)
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if kind == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, previous, strict=True))
        for i in range(stride if kind in (1, 3, 4) else 0):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(line) if channels == 3 else bytes(b for i, b in enumerate(line) if i % 4 != 3))
        previous = line
    return width, height, rows


def colour_count(rows: list[bytes], rgb: tuple[int, int, int], tolerance: int = 6) -> int:
    count = 0
    for line in rows:
        for x in range(0, len(line), 3):
            if all(abs(line[x + c] - rgb[c]) <= tolerance for c in range(3)):
                count += 1
    return count


def test_chromium_renders_the_usage_chart(tmp_path: Path) -> None:
    engine = create_db_engine(f"sqlite:///{tmp_path / 'tollway.db'}")
    upgrade_database(engine)
    with session_factory(engine).begin() as session:
        seed(session)
        report = usage_report(session, MONTH)
    engine.dispose()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page, screenshot = ARTIFACTS / "usage-report.html", ARTIFACTS / "usage-report.png"
    page.write_text(to_html(report), encoding="utf-8")
    screenshot.unlink(missing_ok=True)

    dom = chromium(tmp_path, page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    parser = BarCounter()
    parser.feed(dom.stdout)
    assert parser.bars == [day.day.isoformat() for day in report.days] and len(parser.bars) == 5
    assert parser.title.startswith(f"tollway usage report {MONTH}")

    shot = chromium(tmp_path, page, f"--screenshot={screenshot}")
    assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-2000:]
    data = screenshot.read_bytes()
    assert len(data) > 10_000  # a blank 1200×900 page compresses to a few KB
    width, height, rows = png_pixels(data)
    assert (width, height) == (1200, 900)
    assert len({line[x:x + 3] for line in rows[::10] for x in range(0, len(line), 30)}) > 5  # not one colour
    # Bars of every segment colour are on screen (not just in the DOM), and big enough to see.
    for name, hex_colour in COLOURS.items():
        rgb = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
        assert colour_count(rows, rgb) > 200, f"no {name} bars in the screenshot"  # type: ignore[arg-type]
