"""One step of a batch: claim its lease, run its pending lines through the gateway, end it when done.

A step (`run_step`) holds the batch's lease (accounting/batch_runs.py) and runs the lines without a
recorded result, `concurrency` at a time, each as an HTTP request to the gateway
(workers/jobs/line_client.py), recording each answer as soon as it arrives. A monitor renews the
lease every few seconds and decides when to stop starting lines:

- the batch is `cancelling` → in-flight lines finish, the rest are recorded `batch_cancelled`,
  the batch ends `cancelled` with its partial output;
- its completion window has passed → the same, as `batch_expired` / `expired`;
- the step has run `step_s` → the lease is released and the caller queues a continuation;
- the gateway cannot answer → likewise, the continuation waits a little;
- another runner took the lease (this one stalled) → stop, touching nothing more.

When every line has a result the batch goes `finalizing` (committed) and then `completed` with its
files. Nothing here holds state between steps: a step that dies leaves recorded results and a
lease that lapses, and any later step picks up from the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, TypeVar

import aiohttp
from opentelemetry.trace import SpanKind, Tracer
from sqlalchemy.orm import Session, sessionmaker

from accounting import batch_output, batch_runs
from accounting.batch_input import BatchRequest, validate_batch_input
from accounting.batches import UNFINISHED, transition
from accounting.file_store import FileStore, MissingObjectError
from accounting.models import Batch, File, utcnow
from workers.jobs.line_client import Unavailable, send_line
from workers.wire.telemetry import PROPAGATOR

log = logging.getLogger("tollway.jobs")
T = TypeVar("T")
Outcome = Literal["ended", "continue", "retry_later", "busy", "lost"]
"""What the caller does next: nothing (ended / busy: someone else runs it / lost: ditto), queue a
continuation now (continue) or after a pause (retry_later)."""
NO_LIMIT = 2**62  # the input was validated at upload; a runner never refuses it for size
MONITOR_INTERVAL_S = 1.0


@dataclass(frozen=True)
class RunnerConfig:
    gateway_url: str
    admin_key: str
    concurrency: int = 16
    lease_s: float = 60.0
    step_s: float = 300.0
    line_timeout_s: float = 600.0


@dataclass(frozen=True)
class Claimed:
    status: str
    endpoint: str
    expires_at: datetime
    input_key: str | None


class BatchStep:
    """One step on one batch by one runner (`runner_id` must be unique per step)."""

    def __init__(self, batch_id: str, runner_id: str, sessions: sessionmaker[Session], store: FileStore,
                 config: RunnerConfig, tracer: Tracer | None = None) -> None:
        self.batch_id, self.runner_id = batch_id, runner_id
        self.sessions, self.store, self.config = sessions, store, config
        self.tracer = tracer  # each line a CLIENT span under the current (run task) span
        self.stop: str | None = None  # why no more lines start: cancelled, expired, step, unavailable, lost

    async def _db(self, work: Callable[[Session], T]) -> T:
        def run() -> T:
            with self.sessions() as session, session.begin():
                return work(session)

        return await asyncio.to_thread(run)

    # -- claiming and ending ----------------------------------------------------------------------
    def _claim(self, session: Session) -> Claimed | None:
        batch = batch_runs.claim(session, self.batch_id, self.runner_id, self.config.lease_s)
        if batch is None:
            return None
        if batch.status == "validating" and utcnow() < batch.expires_at:
            transition(batch, "in_progress")
        source = session.get(File, batch.input_file_id)
        key = source.storage_key if source is not None and source.deleted_at is None else None
        return Claimed(batch.status, batch.endpoint, batch.expires_at, key)

    def _to_finalizing(self, session: Session) -> None:
        batch = session.get(Batch, self.batch_id, populate_existing=True)
        if batch is not None and batch.runner_id == self.runner_id and batch.status == "in_progress":
            transition(batch, "finalizing")  # committed on its own: visible while the files are written

    def _end(self, session: Session, terminal: str, requests: list[BatchRequest]) -> None:
        """End the batch as `terminal` with its files; lines without a result are given up."""
        batch = session.get(Batch, self.batch_id, populate_existing=True)
        if batch is None or batch.runner_id != self.runner_id or batch.status not in UNFINISHED:
            return  # lost the lease meanwhile: whoever holds it ends the batch
        if batch.status == "cancelling":
            terminal = "cancelled"  # a cancel that raced the end wins (its only way out)
        done = batch_runs.recorded_lines(session, self.batch_id)
        unrun = [(r.line, r.custom_id) for r in requests if r.line not in done]
        if terminal == "failed":
            batch.errors_json = [{"code": "input_file_missing", "param": None, "line": None,
                                  "message": "the batch's input file was deleted before every line ran"}]
        written: list[str] = []
        try:
            batch_output.finalize(session, self.store, batch, terminal, unrun, written)
        except BaseException:
            for key in written:  # the rows will not be committed: their bytes must not linger
                self.store.delete(key)
            raise

    # -- running lines ----------------------------------------------------------------------------
    async def _monitor(self, claimed: Claimed, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self.stop is None:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            status = await self._db(lambda s: batch_runs.renew(s, self.batch_id, self.runner_id, self.config.lease_s))
            if status is None:
                self.stop = "lost"
            elif status == "cancelling":
                self.stop = "cancelled"
            elif utcnow() >= claimed.expires_at:
                self.stop = "expired"
            elif loop.time() >= deadline:
                self.stop = "step"

    async def _run_line(self, http: aiohttp.ClientSession, claimed: Claimed, request: BatchRequest) -> None:
        if self.tracer is None:
            await self._send_line(http, claimed, request, None)
            return
        with self.tracer.start_as_current_span("batch.line", kind=SpanKind.CLIENT, attributes={
                "tollway.batch.id": self.batch_id, "tollway.batch.line": request.line,
                "url.path": claimed.endpoint}) as span:
            headers: dict[str, str] = {}
            PROPAGATOR.inject(headers)  # the gateway continues this trace
            status = await self._send_line(http, claimed, request, headers)
            span.set_attribute("tollway.batch.line_recorded", status is not None)
            if status is not None:
                span.set_attribute("http.response.status_code", status)

    async def _send_line(self, http: aiohttp.ClientSession, claimed: Claimed, request: BatchRequest,
                         trace_headers: dict[str, str] | None) -> int | None:
        """Sends the line and records its answer; the answer's status (None: nothing recorded)."""
        try:
            answer = await send_line(http, self.config.gateway_url, claimed.endpoint, self.config.admin_key,
                                     self.batch_id, request.line, request.body,
                                     timeout_s=self.config.line_timeout_s, should_stop=lambda: self.stop is not None,
                                     trace_headers=trace_headers)
        except Unavailable as exc:
            if self.stop is None:
                log.warning("batch %s line %d: %s; pausing the batch", self.batch_id, request.line, exc)
                self.stop = "changed" if exc.stop_batch else "unavailable"
            return None
        result = batch_runs.LineResult.from_response(request.line, request.custom_id, answer.status, answer.body)
        await self._db(lambda s: batch_runs.record_result(s, self.batch_id, result))
        return answer.status

    async def _run_lines(self, claimed: Claimed, pending: list[BatchRequest]) -> None:
        queue = iter(pending)

        async def lane(http: aiohttp.ClientSession) -> None:
            for request in queue:  # one shared iterator: each line is taken by exactly one lane
                if self.stop is not None:
                    return
                await self._run_line(http, claimed, request)

        loop = asyncio.get_running_loop()
        monitor = asyncio.create_task(self._monitor(claimed, loop.time() + self.config.step_s))
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                await asyncio.gather(*(lane(http) for _ in range(max(1, self.config.concurrency))))
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor

    async def run(self) -> Outcome:
        claimed = await self._db(self._claim)
        if claimed is None:
            return "busy"
        if claimed.status == "finalizing":  # a previous step died while writing the files
            await self._db(lambda s: self._end(s, "completed", []))
            return "ended"
        requests = await self._requests(claimed)
        if requests is None:  # the input file was deleted: end with what ran
            await self._db(lambda s: self._end(s, "failed", []))
            return "ended"
        done = await self._db(lambda s: batch_runs.recorded_lines(s, self.batch_id))
        pending = [r for r in requests if r.line not in done]
        if claimed.status == "cancelling":
            self.stop = "cancelled"
        elif utcnow() >= claimed.expires_at:
            self.stop = "expired"
        elif pending:
            await self._run_lines(claimed, pending)
        return await self._after(requests)

    async def _requests(self, claimed: Claimed) -> list[BatchRequest] | None:
        if claimed.input_key is None:
            return None
        try:
            data = await asyncio.to_thread(self.store.get, claimed.input_key)
        except MissingObjectError:
            return None
        parsed = await asyncio.to_thread(validate_batch_input, data, max_lines=NO_LIMIT, max_bytes=NO_LIMIT)
        return parsed.requests

    async def _after(self, requests: list[BatchRequest]) -> Outcome:
        if self.stop == "lost":
            return "lost"
        if self.stop == "changed":  # the gateway saw a new status: read it
            status = await self._db(lambda s: batch_runs.renew(s, self.batch_id, self.runner_id, self.config.lease_s))
            self.stop = "cancelled" if status == "cancelling" else "unavailable"
        if self.stop in ("cancelled", "expired"):
            await self._db(lambda s: self._end(s, self.stop or "", requests))
            return "ended"
        done = await self._db(lambda s: batch_runs.recorded_lines(s, self.batch_id))
        if all(r.line in done for r in requests):
            await self._db(self._to_finalizing)
            await self._db(lambda s: self._end(s, "completed", requests))
            return "ended"
        await self._db(lambda s: batch_runs.release(s, self.batch_id, self.runner_id))
        return "retry_later" if self.stop == "unavailable" else "continue"
