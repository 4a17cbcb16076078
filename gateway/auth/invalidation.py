"""Every gateway replica drops its cached keys when anyone publishes an invalidation (the admin API,
the CLI: workers/wire/key_events.py), so a revoked key stops working everywhere at once.

Bounded waits: connecting and every command (SUBSCRIBE) time out after `REDIS_TIMEOUT_S`. Waiting
for the next message is unbounded by design (there may be none for days); a Redis host that
vanished without closing the connection is found by TCP keepalive (`KEEPALIVE`: ~20 s), and the
listener reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from gateway.auth.keys import KeyCache
from workers.wire.key_events import INVALIDATION_CHANNEL

log = logging.getLogger("tollway.gateway")
REDIS_TIMEOUT_S = 2.0
KEEPALIVE = {getattr(socket, name): value for name, value in
             (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2)) if hasattr(socket, name)}


async def listen_for_invalidations(redis_url: str, cache: KeyCache) -> None:
    """Clear `cache` whenever any process publishes on the invalidation channel (runs until cancelled)."""
    import redis.asyncio as redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    while True:
        client = redis.from_url(redis_url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S,
                                socket_keepalive=True, socket_keepalive_options=KEEPALIVE,
                                retry=Retry(NoBackoff(), 0))  # this loop is the retry
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(INVALIDATION_CHANNEL)
                cache.invalidate()  # anything may have changed while we were not listening
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        cache.invalidate()
        except (OSError, redis.RedisError) as exc:
            log.warning("auth invalidation channel lost (%r); retrying in 1 s", exc)
            await asyncio.sleep(1.0)
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()


