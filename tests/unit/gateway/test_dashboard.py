"""/admin/dashboard: admin-key login by POST form only (a random session token as the cookie, never
the key; sessions themselves: test_dashboard_session.py), the live panel after traffic, and trace
waterfalls joining the gateway's and the worker's spans."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest
import pytest_asyncio

from gateway.auth.dashboard_session import COOKIE
from tests.unit.gateway.test_tracing import Traced, start, streamed_chat

pytestmark = pytest.mark.asyncio
ADMIN_KEY = "test-admin-key"


class Dom(HTMLParser):
    """Ids, classes and data-* of every element, in document order."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.elements: list[dict[str, str]] = []
        self.text: dict[str, str] = {}
        self._open: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = {"tag": tag, **{k: v or "" for k, v in attrs}}
        self.elements.append(element)
        self._open.append(element.get("id", ""))

    def handle_data(self, data: str) -> None:
        for element_id in self._open:
            if element_id:
                self.text[element_id] = self.text.get(element_id, "") + data

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def with_class(self, name: str) -> list[dict[str, str]]:
        return [e for e in self.elements if name in e.get("class", "").split()]


@pytest_asyncio.fixture
async def stack(aiohttp_client, aiohttp_server, tmp_path: Path, tiny):
    traced = Traced()
    client, key, engine = await start(aiohttp_client, aiohttp_server, tmp_path, tiny, traced)
    yield client, key, traced
    engine.shutdown()


async def test_the_dashboard_needs_the_admin_key(stack) -> None:
    client, key, _ = stack
    response = await client.get("/admin/dashboard")
    assert response.status == 401 and 'name="key"' in await response.text()  # the login form
    for wrong in ({"key": key}, {"key": ""}):  # a tenant key is not the admin key
        response = await client.post("/admin/dashboard/login", data=wrong, allow_redirects=False)
        assert response.status == 401 and COOKIE not in response.cookies
    assert (await client.get("/admin/dashboard/panel")).status == 401
    client.session.cookie_jar.update_cookies({COOKIE: "forged"})
    assert (await client.get("/admin/dashboard")).status == 401

    response = await client.post("/admin/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False)
    assert response.status == 303 and response.headers["Location"] == "/admin/dashboard"
    cookie = response.cookies[COOKIE]
    assert len(cookie.value) >= 43 and ADMIN_KEY not in cookie.value  # a random token, not the key
    assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/admin/dashboard"
    assert cookie["max-age"] == str(12 * 3600)
    assert (await client.get("/admin/dashboard")).status == 200  # the cookie jar now holds it
    response = await client.post("/admin/dashboard/logout", allow_redirects=False)
    assert response.status == 303 and response.cookies[COOKIE].value == ""
    client.session.cookie_jar.update_cookies({COOKIE: cookie.value})  # the old cookie, kept by someone
    assert (await client.get("/admin/dashboard")).status == 401  # the session itself is gone


async def test_a_get_never_logs_in_and_the_bearer_works(stack) -> None:
    client, _, _ = stack
    response = await client.get(f"/admin/dashboard/login?key={ADMIN_KEY}", allow_redirects=False)
    assert response.status == 200 and 'method="post"' in await response.text()  # the form, nothing more
    assert COOKIE not in response.cookies and "Set-Cookie" not in response.headers
    assert (await client.get("/admin/dashboard")).status == 401
    response = await client.get("/admin/dashboard", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status == 200 and response.headers["Cache-Control"] == "no-store"


async def test_live_numbers_workers_usage_and_waterfalls_after_traffic(stack) -> None:
    client, key, _ = stack
    for _ in range(3):
        await streamed_chat(client, key)
    response = await client.get("/admin/dashboard", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status == 200
    text = await response.text()
    assert "<script" in text and "http://" not in text.split("<main")[0]  # nothing from elsewhere
    dom = Dom(text)
    assert dom.text["tile-request-rate"].startswith("Requests / s0.05")  # 3 requests over 60 s
    assert "3 in the last minute" in dom.text["tile-request-rate"]
    assert "18 in the last minute" in dom.text["tile-tokens-per-second"]  # 3 × 6 tokens
    assert "ms" in dom.text["tile-ttft"]
    assert len(dom.with_class("worker")) == 1 and "up" in dom.text["workers"] and "tiny" in dom.text["workers"]
    assert len(dom.with_class("tenant")) == 1 and "acme" in dom.text["tenants"]
    traces = dom.with_class("trace")
    assert len(traces) == 3
    rows = dom.with_class("span-row")
    names = [r["data-name"] for r in rows]
    assert names.count("chat tiny") == 3 and names.count("worker.generate") == 3
    assert {r["data-service"] for r in rows} == {"tollway-gateway", "tollway-worker", "engine"}
    assert names.count("engine.decode") == 3 and names.count("gateway.metering.commit") == 3

    panel = await client.get("/admin/dashboard/panel", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert panel.status == 200 and "<html" not in await panel.text() and "tile-request-rate" in await panel.text()


async def test_without_tracing_the_dashboard_says_how_to_turn_it_on(aiohttp_client, aiohttp_server, tmp_path,
                                                                    tiny) -> None:
    client, key, engine = await start(aiohttp_client, aiohttp_server, tmp_path, tiny, None)
    try:
        await streamed_chat(client, key)
        text = await (await client.get("/admin/dashboard", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).text()
    finally:
        engine.shutdown()
    dom = Dom(text)
    assert "TOLLWAY_TRACING" in dom.text["traces-off"] and not dom.with_class("trace")
    assert "1 in the last minute" in dom.text["tile-request-rate"]
