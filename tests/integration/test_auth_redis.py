"""Key revocation reaches every gateway replica at once through Redis pub/sub (real Redis)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from accounting.api_keys import create_key, revoke_key
from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.tenants import create_tenant
from gateway.api.errors import ApiError
from gateway.auth.invalidation import listen_for_invalidations
from gateway.auth.keys import KeyCache
from workers.wire.key_events import publish_invalidation

pytestmark = pytest.mark.services


@pytest.mark.asyncio
async def test_a_revocation_published_by_one_process_clears_every_replica(redis_url: str, tmp_path: Path) -> None:
    engine = create_db_engine(f"sqlite:///{tmp_path}/t.db")
    upgrade_database(engine)
    sessions = session_factory(engine)
    with sessions() as session, session.begin():
        create_tenant(session, "acme")
        row, key = create_key(session, "acme")
    replicas = [KeyCache(sessions, ttl_s=3600) for _ in range(3)]  # a TTL far beyond the test
    listeners = [asyncio.create_task(listen_for_invalidations(redis_url, cache)) for cache in replicas]
    try:
        await asyncio.sleep(0.3)  # subscribed
        for cache in replicas:
            await cache.authenticate(key)
        with sessions() as session, session.begin():
            revoke_key(session, row.id)
        await asyncio.to_thread(publish_invalidation, redis_url)  # what the CLI and the admin API do
        await asyncio.sleep(0.3)
        for cache in replicas:
            with pytest.raises(ApiError) as refused:
                await cache.authenticate(key)
            assert refused.value.status == 401
    finally:
        for task in listeners:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        engine.dispose()
