"""Every gateway replica drops its cached keys when anyone publishes an invalidation (the admin API,
the CLI: workers/wire/key_events.py), so a revoked key stops working everywhere at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.auth.keys import KeyCache
from workers.wire.key_events import INVALIDATION_CHANNEL

log = logging.getLogger("tollway.gateway")


async def listen_for_invalidations(redis_url: str, cache: KeyCache) -> None:
    """Clear `cache` whenever any process publishes on the invalidation channel (runs until cancelled)."""
    import redis.asyncio as redis

    while True:
        client = redis.from_url(redis_url)
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


