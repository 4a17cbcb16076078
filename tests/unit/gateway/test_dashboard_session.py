"""Dashboard sessions are server-side (a SQL row per login), so every gateway replica honours and
revokes the same ones: a login on one replica works on another, a logout on either ends it for
both, a changed admin key ends every session, an expired one is refused, and the cookie is Secure
when the request came over https (directly or through a TLS-terminating proxy)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import select

from accounting.db import create_db_engine, session_factory
from accounting.models import DashboardSession
from gateway.app import create_app
from gateway.auth.dashboard_session import COOKIE
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.asyncio
ADMIN_KEY = "tw-admin-sessions-test"


async def replica(aiohttp_client, tmp_path: Path, name: str, admin_key: str = ADMIN_KEY, **settings):
    """A gateway replica with its own home, on the database every replica shares."""
    home = tmp_path / name
    return await aiohttp_client(create_app(GatewaySettings(
        home=home, database_url=f"sqlite:///{tmp_path / 'shared.db'}", worker_urls="http://127.0.0.1:9",
        admin_key=admin_key, **settings)))


async def log_in(client, **headers: str) -> str:
    response = await client.post("/admin/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False,
                                 headers=headers)
    assert response.status == 303, await response.text()
    client.session.cookie_jar.clear()  # each request below names its cookie itself
    return response.cookies[COOKIE].value


async def page(client, token: str) -> int:
    return (await client.get("/admin/dashboard/panel", headers={"Cookie": f"{COOKIE}={token}"})).status


async def test_replicas_share_sessions_and_a_logout_anywhere_ends_it_everywhere(aiohttp_client,
                                                                                tmp_path: Path) -> None:
    a, b = await replica(aiohttp_client, tmp_path, "a"), await replica(aiohttp_client, tmp_path, "b")
    token = await log_in(a)
    assert await page(a, token) == 200 and await page(b, token) == 200
    other = await log_in(b)
    assert other != token  # a random token per login, not a function of the key
    response = await b.post("/admin/dashboard/logout", headers={"Cookie": f"{COOKIE}={token}"},
                            allow_redirects=False)
    assert response.status == 303 and response.cookies[COOKIE].value == ""
    assert await page(a, token) == 401 and await page(b, token) == 401
    assert await page(a, other) == 200  # only that session ended

    engine = create_db_engine(f"sqlite:///{tmp_path / 'shared.db'}")
    with session_factory(engine)() as session:
        stored = [row.token_hash for row in session.scalars(select(DashboardSession))]
    engine.dispose()
    assert len(stored) == 1 and other not in stored and len(stored[0]) == 64  # a hash, never the token


async def test_a_changed_admin_key_ends_every_session(aiohttp_client, tmp_path: Path) -> None:
    token = await log_in(await replica(aiohttp_client, tmp_path, "old"))
    rotated = await replica(aiohttp_client, tmp_path, "new", admin_key="tw-admin-rotated")
    assert await page(rotated, token) == 401


async def test_an_expired_session_is_refused(aiohttp_client, tmp_path: Path) -> None:
    client = await replica(aiohttp_client, tmp_path, "a", dashboard_session_ttl_s=1)
    response = await client.post("/admin/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False)
    token = response.cookies[COOKIE].value
    client.session.cookie_jar.clear()
    assert response.cookies[COOKIE]["max-age"] == "1"
    assert await page(client, token) == 200
    await asyncio.sleep(1.1)
    assert await page(client, token) == 401  # the server's own clock, whatever the browser keeps


async def test_the_cookie_is_secure_over_https_only(aiohttp_client, tmp_path: Path) -> None:
    client = await replica(aiohttp_client, tmp_path, "a")
    plain = await client.post("/admin/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False)
    assert not plain.cookies[COOKIE]["secure"]
    proxied = await client.post("/admin/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False,
                                headers={"X-Forwarded-Proto": "https"})
    assert proxied.cookies[COOKIE]["secure"]


async def test_bad_logins_and_cookies_are_refused_without_a_500(aiohttp_client, tmp_path: Path) -> None:
    client = await replica(aiohttp_client, tmp_path, "a")
    for data in ({"key": "wrong"}, {}, {"key": ""}):
        response = await client.post("/admin/dashboard/login", data=data, allow_redirects=False)
        assert response.status == 401 and COOKIE not in response.cookies
    response = await client.post("/admin/dashboard/login", json={"key": ADMIN_KEY}, allow_redirects=False)
    assert response.status == 401  # a form post only
    for token in ("x" * 1000, "forged", "%00"):
        assert await page(client, token) == 401
