"""Batch jobs between the gateway, the Celery runners and `tollway up`: task and queue names, the
header a runner's batch line carries, and which broker they all meet on.

The gateway queues `RUN_TASK` by name (it never imports the Celery tasks); the runners
(workers/jobs/) consume `QUEUE` and send each line back to the gateway with the admin key and
`BATCH_HEADER`, which bills the line to the batch's tenant at batch priority.
"""

from __future__ import annotations

from pathlib import Path

QUEUE = "tollway.batches"
RUN_TASK = "tollway.batches.run"
SWEEP_TASK = "tollway.batches.sweep"
BATCH_HEADER = "X-Tollway-Batch-Id"


def broker_url(broker_url: str | None, redis_url: str | None, home: Path) -> str:
    """The Celery broker: TOLLWAY_BROKER_URL, else TOLLWAY_REDIS_URL (production), else kombu's
    SQLAlchemy transport on SQLite in $TOLLWAY_HOME (no server; what `tollway up` uses)."""
    if broker_url:
        return broker_url
    if redis_url:
        return redis_url
    return f"sqla+sqlite:///{home.resolve() / 'celery-broker.sqlite'}"


def is_redis_broker(url: str) -> bool:
    """Whether the Celery broker `url` is Redis (whose transport takes socket timeouts as options)."""
    return url.split("://", 1)[0] in ("redis", "rediss", "redis+socket")
