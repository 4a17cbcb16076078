"""The gateway's key cache: one lookup per key however many requests wait, TTLs, invalidation."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import pytest

from accounting.api_keys import create_key, revoke_key
from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.tenants import create_tenant
from gateway.api.errors import ApiError
from gateway.auth.keys import KeyCache
from workers.wire.files import load_or_create_admin_key


@pytest.fixture
def sessions(tmp_path: Path):
    engine = create_db_engine(f"sqlite:///{tmp_path}/t.db")
    upgrade_database(engine)
    yield session_factory(engine)
    engine.dispose()


def new_key(sessions) -> tuple[int, str]:
    with sessions() as session, session.begin():
        create_tenant(session, "acme")
        row, key = create_key(session, "acme")
        return row.id, key


class CountingSessions:
    def __init__(self, sessions) -> None:
        self.sessions, self.calls, self.lock = sessions, 0, threading.Lock()

    def __call__(self):
        with self.lock:
            self.calls += 1
        return self.sessions()


@pytest.mark.asyncio
async def test_concurrent_requests_share_one_lookup(sessions) -> None:
    _, key = new_key(sessions)
    counting = CountingSessions(sessions)
    cache = KeyCache(counting, ttl_s=60)
    records = await asyncio.gather(*(cache.authenticate(key) for _ in range(50)))
    assert counting.calls == 1 and {r.tenant_name for r in records} == {"acme"}
    await cache.authenticate(key)
    assert counting.calls == 1  # cached


@pytest.mark.asyncio
async def test_invalidation_makes_a_revocation_immediate(sessions) -> None:
    key_id, key = new_key(sessions)
    cache = KeyCache(sessions, ttl_s=60)
    await cache.authenticate(key)
    with sessions() as session, session.begin():
        revoke_key(session, key_id)
    await cache.authenticate(key)  # still cached: the TTL alone would let it through for a minute
    cache.invalidate()
    with pytest.raises(ApiError) as refused:
        await cache.authenticate(key)
    assert refused.value.status == 401


@pytest.mark.asyncio
async def test_missing_and_unknown_keys_are_401(sessions) -> None:
    cache = KeyCache(sessions)
    for key in (None, "", "tw-unknown"):
        with pytest.raises(ApiError) as refused:
            await cache.authenticate(key)
        assert refused.value.status == 401


def test_the_admin_key_is_generated_once_with_mode_600(tmp_path: Path) -> None:
    key, path = load_or_create_admin_key(None, tmp_path)
    assert path is not None and path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_admin_key(None, tmp_path) == (key, path)
    assert load_or_create_admin_key("configured", tmp_path) == ("configured", None)


@pytest.mark.asyncio
async def test_the_invalidation_listener_gives_up_on_a_silent_redis_and_retries(caplog) -> None:
    """Subscribing to a Redis that never answers times out (socket_timeout) and the listener
    retries, rather than hanging with a stale cache."""
    from gateway.auth.invalidation import REDIS_TIMEOUT_S, listen_for_invalidations
    from tests.net import silent_listener

    cache = KeyCache(lambda: None, 5.0)  # type: ignore[arg-type,return-value]
    with silent_listener() as port:
        listener = asyncio.create_task(listen_for_invalidations(f"redis://127.0.0.1:{port}/0", cache))
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S * 3):
                while "auth invalidation channel lost" not in caplog.text:
                    await asyncio.sleep(0.05)
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
    assert "Timeout" in caplog.text


def test_publishing_an_invalidation_to_a_silent_redis_gives_up(caplog) -> None:
    from tests.net import silent_listener
    from workers.wire.key_events import PUBLISH_TIMEOUT_S, publish_invalidation

    with silent_listener() as port:
        started = time.monotonic()
        publish_invalidation(f"redis://127.0.0.1:{port}/0")
    assert time.monotonic() - started < PUBLISH_TIMEOUT_S * 2
    assert "could not publish key invalidation" in caplog.text
