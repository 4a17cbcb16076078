"""Queueing a batch's run task on Celery, by task name only (the gateway never imports workers/).

`CeleryDispatcher` sends `tollway.batches.run(batch_id)` to the broker of `celery_broker_url`
(Redis in production, kombu's SQLAlchemy transport on SQLite for `tollway up`). Nothing connects
until the first dispatch. A dispatch that fails (broker down) is not fatal: the batch stays
`validating` with no `dispatched_at`, and the periodic sweep of the Celery workers queues it.

Bounded: connecting to the broker gives up after `BROKER_TIMEOUT_S`, a Redis broker's socket
operations too, and the request waits for a dispatch at most `DISPATCH_TIMEOUT_S` (the send goes
on in its thread; if it succeeds late, the sweep may queue the batch a second time, which its
runner lease makes harmless).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from aiohttp import web

from workers.wire.batches import QUEUE, RUN_TASK, is_redis_broker
from workers.wire.telemetry import PROPAGATOR

log = logging.getLogger("tollway.gateway")
SEND_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1.0}
BROKER_TIMEOUT_S = 5.0
DISPATCH_TIMEOUT_S = 15.0


class BatchDispatcher(Protocol):
    """Queues a batch's run task."""

    def dispatch(self, batch_id: str) -> None:
        """Send the run task; raises when the broker cannot take it."""
        ...


class CeleryDispatcher:
    """Sends run tasks by name; the Celery app is made on first use (it holds a connection pool)."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self._app: Any = None

    def _celery(self) -> Any:
        if self._app is None:
            import celery

            self._app = celery.Celery("tollway-gateway", broker=self.broker_url, set_as_current=False)
            self._app.conf.broker_connection_retry_on_startup = False
            self._app.conf.broker_connection_timeout = BROKER_TIMEOUT_S
            # Redis: no socket operation waits longer. Only there: kombu's SQLAlchemy transport (`tollway up`'s
            # SQLite broker) hands its transport options to `create_engine`, which refuses these, so every
            # dispatch failed and each batch waited for the sweep (up to its 30 s interval) to be queued.
            if is_redis_broker(self.broker_url):
                self._app.conf.broker_transport_options = {"socket_timeout": BROKER_TIMEOUT_S,
                                                           "socket_connect_timeout": BROKER_TIMEOUT_S}
        return self._app

    def dispatch(self, batch_id: str) -> None:
        # The creating request's trace (current in this thread: to_thread copies the context), if
        # traced: the run task's spans link to it (workers/jobs/tasks.py).
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier)
        kwargs = {"link": carrier["traceparent"]} if "traceparent" in carrier else None
        self._celery().send_task(RUN_TASK, args=[batch_id], kwargs=kwargs, queue=QUEUE, retry=True,
                                 retry_policy=SEND_RETRY_POLICY)


BATCH_DISPATCHER = web.AppKey("batch_dispatcher", BatchDispatcher)  # type: ignore[type-abstract]
"""Set by `setup_batches` (tests may set their own before the app starts)."""


def setup_batches(app: web.Application, broker_url: str) -> None:
    """The app's dispatcher: a `CeleryDispatcher` unless one was set already."""
    if BATCH_DISPATCHER not in app:
        app[BATCH_DISPATCHER] = CeleryDispatcher(broker_url)


async def dispatch(app: web.Application, batch_id: str) -> bool:
    """Queue the batch's run task off the event loop; False (logged) when the broker refused or did
    not answer within DISPATCH_TIMEOUT_S."""
    try:
        async with asyncio.timeout(DISPATCH_TIMEOUT_S):
            await asyncio.to_thread(app[BATCH_DISPATCHER].dispatch, batch_id)
    except Exception as exc:  # the broker is down or hangs: the sweep queues the batch later
        log.warning("could not queue batch %s (%r); the batch sweep will queue it", batch_id, exc)
        return False
    return True
