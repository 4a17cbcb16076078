"""Key invalidations: whoever changes a key or tenant (the admin API, the CLI) tells every gateway
replica to drop its cached key lookups, over one Redis pub/sub channel.

Without Redis nothing is sent: replicas catch up within their cache TTL (TOLLWAY_AUTH_CACHE_TTL_S).
The gateway's listener is gateway/auth/invalidation.py.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tollway")
INVALIDATION_CHANNEL = "tollway:auth:invalidate"
PUBLISH_TIMEOUT_S = 2.0
"""Connecting, then publishing, each give up after this; no retry (a lost invalidation only means
replicas catch up within their cache TTL)."""


def publish_invalidation(redis_url: str | None) -> None:
    """Tell every gateway replica to drop cached keys (sync: for the CLI and admin views' threads)."""
    if not redis_url:
        return
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    try:
        client = redis.from_url(redis_url, socket_connect_timeout=PUBLISH_TIMEOUT_S, socket_timeout=PUBLISH_TIMEOUT_S,
                                retry=Retry(NoBackoff(), 0))
        client.publish(INVALIDATION_CHANNEL, b"keys")
        client.close()
    except redis.RedisError as exc:
        log.warning("could not publish key invalidation (%r); replicas catch up within their cache TTL", exc)
