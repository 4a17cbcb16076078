"""Key invalidations: whoever changes a key or tenant (the admin API, the CLI) tells every gateway
replica to drop its cached key lookups, over one Redis pub/sub channel.

Without Redis nothing is sent: replicas catch up within their cache TTL (TOLLWAY_AUTH_CACHE_TTL_S).
The gateway's listener is gateway/auth/invalidation.py.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tollway")
INVALIDATION_CHANNEL = "tollway:auth:invalidate"


def publish_invalidation(redis_url: str | None) -> None:
    """Tell every gateway replica to drop cached keys (sync: for the CLI and admin views' threads)."""
    if not redis_url:
        return
    import redis

    try:
        client = redis.from_url(redis_url, socket_timeout=2)
        client.publish(INVALIDATION_CHANNEL, b"keys")
        client.close()
    except redis.RedisError as exc:
        log.warning("could not publish key invalidation (%r); replicas catch up within their cache TTL", exc)
