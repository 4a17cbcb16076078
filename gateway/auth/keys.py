"""Tenant API keys: who a bearer key belongs to.

Keys are looked up by their SHA-256 (never stored or logged in plaintext): a lookup goes to the
database once, then sits in a short-TTL cache. Revocations reach every replica at once through a
Redis pub/sub channel (production) or `invalidate()` (this process); the TTL bounds staleness when
neither is available (e.g. a key revoked from the CLI against SQLite with no Redis). Expiry is
checked on every request, from the cached record, so an expired key is refused to the second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from aiohttp import web
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from accounting.api_keys import AuthRecord, authenticate
from accounting.keys import hash_api_key
from gateway.api.errors import ApiError

log = logging.getLogger("tollway.gateway")
NEGATIVE_TTL_S = 1.0  # unknown keys are remembered briefly, so a new key works within a second


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("api-key") or None  # Azure-style clients


class KeyCache:
    """key hash → AuthRecord (or None = refused), each entry valid for `ttl_s`."""

    def __init__(self, sessions: Callable[[], Session], ttl_s: float = 5.0) -> None:
        self._sessions = sessions
        self._ttl_s = ttl_s
        self._entries: dict[str, tuple[AuthRecord | None, float]] = {}
        # One database lookup per key at a time: concurrent requests with the same key share it.
        self._pending: dict[str, asyncio.Future[AuthRecord | None]] = {}  # key hash → the lookup in flight
        self._generation = 0

    def invalidate(self) -> None:
        """Forget every cached key (revocations are rare; refilling is cheap).

        Lookups already in flight may have read the database before the change: they still answer
        their waiters but are not cached (the generation moved on).
        """
        self._generation += 1
        self._entries.clear()
        self._pending.clear()

    def _lookup(self, key_hash: str) -> AuthRecord | None:
        with self._sessions() as session:
            return authenticate(session, key_hash)

    async def _lookup_once(self, key_hash: str) -> AuthRecord | None:
        task = self._pending.get(key_hash)
        if task is None:
            task = self._pending[key_hash] = asyncio.ensure_future(asyncio.to_thread(self._lookup, key_hash))
            generation = self._generation
            task.add_done_callback(lambda done: self._store(key_hash, done, generation))
        # shield: a waiter that is cancelled (client gone) does not cancel the lookup others share
        return await asyncio.shield(task)

    def _store(self, key_hash: str, done: asyncio.Future[AuthRecord | None], generation: int) -> None:
        if generation != self._generation:
            return
        del self._pending[key_hash]
        if done.cancelled() or done.exception() is not None:
            return
        record = done.result()
        ttl = self._ttl_s if record is not None else NEGATIVE_TTL_S
        self._entries[key_hash] = (record, time.monotonic() + ttl)

    async def authenticate(self, key: str | None) -> AuthRecord:
        if not key:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer tw-...'", code="missing_api_key")
        key_hash = hash_api_key(key)
        now = time.monotonic()
        cached = self._entries.get(key_hash)
        if cached is not None and cached[1] > now:
            record = cached[0]
        else:
            try:
                record = await self._lookup_once(key_hash)
            except OperationalError as exc:  # the database is unreachable
                if cached is None or cached[0] is None:
                    raise ApiError(503, "the key store is unreachable; retry shortly", code="auth_unavailable",
                                   headers={"Retry-After": "1"}) from exc
                record = cached[0]  # a key known before the outage keeps working (stale, not refreshed)
        if record is None or (record.expires_at is not None and record.expires_at <= datetime.now(UTC)):
            raise ApiError(401, "invalid, revoked or expired API key", code="invalid_api_key")
        return record
