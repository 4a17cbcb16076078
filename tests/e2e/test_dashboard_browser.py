"""/admin/dashboard in Debian's headless Chromium, after real traffic through a real gateway and a
real worker (a tiny random-weight model), both tracing.

Chromium logs in as a person does, by posting the admin key in a form (a GET never logs in): it
opens a small page on another port of 127.0.0.1 (the same site) whose form posts the key to
`/admin/dashboard/login` by itself; the gateway sets the session cookie and redirects to the
dashboard. Chromium runs the page's script in virtual time (so its refresh fetches really happen), and dumps the DOM it
built: the live numbers, the worker row, the tenant's usage and a waterfall per request with the
worker's engine spans must be there, and the script must have refreshed the panel. A screenshot is
kept in tests/artifacts/dashboard.png (and checked to show the waterfall's colours). The servers
run in this test's event loop, so Chromium runs as an asyncio subprocess.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch
from aiohttp import web

from gateway.observability.dashboard_render import SERVICE_COLOURS
from tests.e2e.test_report_browser import ARTIFACTS, CHROMIUM, FLAGS, colour_count, png_pixels
from tests.required import require_executable
from tests.unit.gateway.test_dashboard import ADMIN_KEY, Dom
from tests.unit.gateway.test_tracing import Traced, start, streamed_chat
from workers.models.loader import LoadedModel, load_model

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True)
def chromium_present() -> None:  # as the report's browser test
    require_executable(CHROMIUM, "install Debian's chromium (ops/test does, as root) to run the browser tests")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    from workers.models.tiny import write_tiny_model_folder

    return load_model(write_tiny_model_folder(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=3), torch.float32)


def login_poster(login_url: str) -> web.Application:
    """A page that posts the admin key to the gateway's login form as soon as it loads."""
    page = (f'<!DOCTYPE html><html><body onload="document.forms[0].submit()">'
            f'<form method="post" action="{login_url}"><input type="hidden" name="key" value="{ADMIN_KEY}">'
            f'</form></body></html>')

    async def serve(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", serve)
    return app


async def chromium(tmp_path: Path, url: str, *extra: str) -> tuple[int, str, str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    process = await asyncio.create_subprocess_exec(
        str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *extra, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode or 0, stdout.decode(errors="replace"), stderr.decode(errors="replace")


async def test_chromium_renders_the_dashboard_with_live_numbers(aiohttp_client, aiohttp_server, tmp_path: Path,
                                                               tiny: LoadedModel) -> None:
    traced = Traced()
    client, key, engine = await start(aiohttp_client, aiohttp_server, tmp_path, tiny, traced)
    try:
        for _ in range(4):
            await streamed_chat(client, key)
        poster = await aiohttp_server(login_poster(str(client.make_url("/admin/dashboard/login"))))
        login = str(poster.make_url("/"))

        # 12 s of virtual time: the page's 5 s refresh runs at least twice
        code, dom_text, stderr = await chromium(tmp_path, login, "--virtual-time-budget=12000", "--dump-dom")
        assert code == 0, stderr[-2000:]
        dom = Dom(dom_text)
        body = next(e for e in dom.elements if e["tag"] == "body")
        assert int(body["data-refreshed"]) >= 1, "the page's script never refreshed the panel"
        assert re.match(r"Requests / s0\.0[67]", dom.text["tile-request-rate"])  # 4 requests in the last minute
        assert "4 in the last minute" in dom.text["tile-request-rate"]
        assert "24 in the last minute" in dom.text["tile-tokens-per-second"]
        assert re.search(r"TTFT p50\d+ ms", dom.text["tile-ttft"])
        assert "tiny" in dom.text["workers"] and "acme" in dom.text["tenants"]
        assert len(dom.with_class("trace")) == 4
        rows = dom.with_class("span-row")
        assert [r["data-name"] for r in rows].count("engine.prefill") == 4
        assert {r["data-service"] for r in rows} == {"tollway-gateway", "tollway-worker", "engine"}

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        screenshot = ARTIFACTS / "dashboard.png"
        screenshot.unlink(missing_ok=True)
        (ARTIFACTS / "dashboard.html").write_text(dom_text, encoding="utf-8")
        code, _, stderr = await chromium(tmp_path, login, "--virtual-time-budget=2000",
                                         f"--screenshot={screenshot}")
        assert code == 0 and screenshot.is_file(), stderr[-2000:]
    finally:
        engine.shutdown()
    width, height, pixels = png_pixels(screenshot.read_bytes())
    assert (width, height) == (1200, 900)
    for service, colour in SERVICE_COLOURS.items():  # the waterfall's bars are on screen, not only in the DOM
        rgb = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
        assert colour_count(pixels, rgb) > 20, f"no {service} bars in the screenshot"  # type: ignore[arg-type]
