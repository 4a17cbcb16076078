"""The engine workers behind this gateway: health, load, models, and the stream of one request.

Ownership: the pool owns one `WorkerState` per configured worker URL and the model catalog it
learns from them (each model's context length and tokenizer, fetched once from a worker's
`/internal/tokenizer`). A background task polls every worker's `/internal/info`; a worker that
fails a poll or a request is out of rotation until a poll succeeds again. `in_flight` counts the
gateway's own open requests to a worker (the router's load signal); only `stream()` changes it.
Requests go over each worker's generate channel (gateway/upstream/channel.py), not one HTTP call each.

Every call to a worker (polls, tokenizer, cancel, traces, the channel's upgrade) carries the workers'
shared secret as its bearer (workers/server/auth.py); a worker that answers 401 holds another secret,
and is logged as such. Every wait here is bounded: polls, cancels and trace fetches by
`_poll_timeout`, the tokenizer download by `TOKENIZER_TIMEOUT_S`; a request's stream by the channel
(gateway/upstream/channel.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from opentelemetry.trace import SpanKind, Tracer, set_span_in_context

from gateway.upstream.channel import WorkerChannel
from gateway.upstream.stream import UpstreamStream
from workers.wire.generate import GenerateBody
from workers.wire.telemetry import PROPAGATOR
from workers.wire.tokenizer import TextTokenizer

log = logging.getLogger("tollway.gateway")
TOKENIZER_TIMEOUT_S = 30.0
WRONG_SECRET = ("the worker refused this gateway's credential: give gateways and workers the same "
                "TOLLWAY_WORKER_SECRET (or one shared $TOLLWAY_HOME/worker.secret)")


@dataclass
class WorkerState:
    url: str
    healthy: bool = False
    in_flight: int = 0
    model: str | None = None
    last_error: str | None = None
    info: dict[str, Any] | None = None  # the worker's last /internal/info (KV blocks, cache, queues)


@dataclass(frozen=True)
class ModelEntry:
    name: str
    context_length: int
    tokenizer: TextTokenizer


class WorkerPool:
    def __init__(self, urls: list[str], session: aiohttp.ClientSession, *, secret: str,
                 health_interval_s: float = 1.0, connect_timeout_s: float = 2.0, tracer: Tracer | None = None) -> None:
        self.workers = {url.rstrip("/"): WorkerState(url.rstrip("/")) for url in urls}
        self.models: dict[str, ModelEntry] = {}
        self._session = session
        self._auth = {"Authorization": f"Bearer {secret}"}  # on every call to a worker
        self._health_interval_s = health_interval_s
        # One generate channel per worker, shared by all of this gateway's requests to it.
        self._channels = {url: WorkerChannel(url, session, connect_timeout_s, self._auth) for url in self.workers}
        self._poll_timeout = aiohttp.ClientTimeout(total=max(connect_timeout_s, 2.0))
        self._task: asyncio.Task[None] | None = None
        self._tracer = tracer  # None: no span, no traceparent
        # Set by the app (gateway/billing/reconcile.py): bills a worker's orphaned usage, awaited
        # in that worker's poll whenever its info reports some.
        self.bill_orphans: Callable[[str], Awaitable[None]] | None = None

    async def start(self) -> None:
        await self.poll_all()
        self._task = asyncio.create_task(self._poll_forever(), name="tollway-worker-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(channel.close() for channel in self._channels.values()))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            await self.poll_all()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(worker) for worker in self.workers.values()))

    async def poll(self, worker: WorkerState) -> None:
        """Refresh one worker's health and model; learn the model's tokenizer the first time."""
        try:
            async with self._session.get(f"{worker.url}/internal/info", headers=self._auth,
                                         timeout=self._poll_timeout) as response:
                if response.status == 401:
                    if worker.last_error != WRONG_SECRET:
                        log.warning("worker %s: %s", worker.url, WRONG_SECRET)
                    self.mark_down(worker, WRONG_SECRET)
                    return
                response.raise_for_status()
                info = await response.json(loads=orjson.loads)
            model = str(info["model"])
            if model not in self.models:
                async with self._session.get(f"{worker.url}/internal/tokenizer", headers=self._auth,
                                             timeout=aiohttp.ClientTimeout(total=TOKENIZER_TIMEOUT_S)) as response:
                    response.raise_for_status()
                    payload = await response.json(loads=orjson.loads)
                self.models[model] = ModelEntry(model, int(info["context_length"]), TextTokenizer.from_payload(payload))
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            self.mark_down(worker, f"health check failed: {exc!r}")
            return
        if not worker.healthy:
            log.info("worker %s is up (model %s)", worker.url, model)
        worker.healthy, worker.model, worker.last_error, worker.info = True, model, None, info
        if self.bill_orphans is not None and info.get("usage_ledger", {}).get("orphans"):
            await self.bill_orphans(worker.url)

    def mark_down(self, worker: WorkerState, reason: str) -> None:
        if worker.healthy:
            log.warning("worker %s is out of rotation: %s", worker.url, reason)
        worker.healthy, worker.last_error = False, reason

    def loads(self, model: str, exclude: set[str] = frozenset()) -> dict[str, int]:  # type: ignore[assignment]
        """In-flight counts of the healthy workers serving `model` (the router's candidates)."""
        return {w.url: w.in_flight for w in self.workers.values()
                if w.healthy and w.model == model and w.url not in exclude}

    def acknowledge(self, url: str, request_id: str) -> None:
        """The request's usage row is committed (see WorkerChannel.acknowledge)."""
        self._channels[url].acknowledge(request_id)

    async def orphans(self, url: str) -> list[dict[str, Any]]:
        """The worker's orphaned usage: billed requests whose channel closed before their ack."""
        async with self._session.get(f"{url}/internal/usage/orphans", headers=self._auth,
                                     timeout=self._poll_timeout) as response:
            response.raise_for_status()
            return list((await response.json(loads=orjson.loads))["orphans"])

    async def acknowledge_orphans(self, url: str, request_ids: list[str]) -> None:
        async with self._session.post(f"{url}/internal/usage/ack", json={"request_ids": request_ids},
                                      headers=self._auth, timeout=self._poll_timeout) as response:
            response.raise_for_status()

    async def cancel(self, url: str, request_id: str) -> None:
        """The `cancel` verb: the worker stops the request and its stream ends with the usage so far.
        Sent on the request's channel; over HTTP when the channel no longer carries it."""
        if await self._channels[url].cancel(request_id):
            return
        try:
            async with self._session.post(f"{url}/internal/requests/{request_id}/cancel", headers=self._auth,
                                          timeout=self._poll_timeout) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("could not cancel %s on %s: %r", request_id, url, exc)

    def stream(self, url: str, body: GenerateBody) -> UpstreamStream:
        """The worker's answer to one generate request, sent on its first read (see UpstreamStream
        for its errors). `aclose()` it: before the end, that aborts the request on the worker."""
        worker = self.workers[url]
        headers: dict[str, str] = {}
        span = None
        if self._tracer is not None:  # the worker joins this trace through `traceparent`
            span = self._tracer.start_span("gateway.worker.generate", kind=SpanKind.CLIENT, attributes={
                "http.request.method": "POST", "server.address": url, "tollway.worker.url": url})
            PROPAGATOR.inject(headers, context=set_span_in_context(span))
        worker.in_flight += 1

        def done() -> None:
            worker.in_flight -= 1

        return UpstreamStream(self._channels[url], body, headers, span, lambda reason: self.mark_down(worker, reason),
                              done)

    async def recent_spans(self, url: str, trace_ids: list[str]) -> list[dict[str, Any]]:
        """The worker's finished spans of these traces (its ring buffer); [] when it has none or fails."""
        try:
            async with self._session.get(f"{url}/internal/traces", params=[("trace_id", t) for t in trace_ids],
                                         headers=self._auth, timeout=self._poll_timeout) as response:
                if response.status != 200:
                    return []
                return list((await response.json(loads=orjson.loads))["spans"])
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError, TypeError):
            return []
