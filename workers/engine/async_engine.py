"""Drives an Engine from one background thread for asyncio callers.

Ownership: only the engine thread touches the Engine. Callers hand it commands (add, abort)
through a queue; it applies them between steps and posts each delta to the caller's asyncio queue
on the caller's loop. Requests are validated on the caller's side first, so a bad request fails
at once with ValueError. Leaving `generate` early (cancellation, a closed connection) aborts the
request, which frees its blocks.

Every request's last delta (the one carrying usage: finished, cancelled, failed, or abandoned by
its caller) also goes to the finished hook when one is set, on the hook's event loop: the worker
server keeps the usage of billed requests there until a gateway acknowledges it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.deltas import Delta
from workers.engine.engine import Engine
from workers.engine.phase_spans import TraceParent
from workers.engine.request import Priority
from workers.wire.sampling import SamplingParams

log = logging.getLogger(__name__)
INFO_INTERVAL_S = 0.25


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue[Delta]


class AsyncEngine:
    def __init__(self, engine: Engine, threads: int = 0) -> None:
        """`threads`: torch's intra-op threads for the engine thread's work (0: leave them as set).

        A process's parallel torch work should all run on this one thread. Each thread that runs
        OpenMP-parallel ops keeps its own pool of OpenMP threads; once the process holds more of them
        than cores, libgomp stops spinning between parallel regions and hands each one over by futex.
        Measured on 2 cores: a quantized decode step 2.2x slower when the loading thread had run
        parallel ops with 2 threads (ops/bench/RESULTS.md, "Issue 22"). So `tollway worker` loads on
        one torch thread and passes its thread count here.
        """
        self.engine = engine
        self._threads = threads
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._stopping = threading.Event()
        self._info: dict[str, Any] = engine.info()
        self._info_time = time.monotonic()
        self._finished_hook: tuple[asyncio.AbstractEventLoop, Callable[[Delta], None]] | None = None
        self._thread = threading.Thread(target=self._run, name="tollway-engine", daemon=True)
        self._thread.start()

    # -- callers' side ----------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, namespace: str = "default",
        priority: Priority = Priority.INTERACTIVE, trace: TraceParent | None = None, weight: float = 1.0,
    ) -> AsyncGenerator[Delta, None]:
        self.engine.validate_request(prompt_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        self._commands.put(("add", (request_id, prompt_ids, params, namespace, priority, trace, weight)))
        finished = False
        try:
            while not finished:
                delta = await stream.deltas.get()
                finished = delta.usage is not None  # the request's last delta (all choices done)
                yield delta
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    def set_finished_hook(self, loop: asyncio.AbstractEventLoop, hook: Callable[[Delta], None]) -> None:
        """Call `hook(last delta)` on `loop` as each request ends, however it ends."""
        self._finished_hook = (loop, hook)

    def cancel(self, request_id: str) -> None:
        """Stop a request but keep its stream: the stream ends with an 'abort' delta carrying the
        usage so far (what the caller bills), unlike hanging up, which drops the stream."""
        self._commands.put(("cancel", request_id))

    def info(self) -> dict[str, Any]:
        """The engine's state as of its last step."""
        return dict(self._info)

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout=30)

    # -- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        while not self._stopping.is_set():
            block = not self.engine.has_work()
            try:
                while True:
                    self._apply(*self._commands.get(block=block, timeout=0.5 if block else None))
                    block = False
            except queue.Empty:
                pass
            try:
                deltas = self.engine.step() if self.engine.has_work() else []
            except Exception:  # a bug must not leave callers hanging: fail what is open, keep serving
                log.exception("engine step failed; failing every open request")
                deltas = self._fail_open_requests()
            # The snapshot walks every running block table, so it is not refreshed on every step:
            # only when a request ended (before delivering, so a caller that saw its last delta
            # sees it gone), when the engine is idle, or every INFO_INTERVAL_S.
            now = time.monotonic()
            if (any(d.usage is not None for d in deltas) or not self.engine.has_work()
                    or now - self._info_time >= INFO_INTERVAL_S):
                self._info, self._info_time = self.engine.info(), now
            self._deliver_step(deltas)

    def _apply(self, command: str, payload: Any) -> None:
        if command == "add":
            request_id = payload[0]
            try:
                self.engine.add_request(*payload)
            except ValueError:  # validated already; reaching here means a race on the same id
                self._deliver(Delta(request_id, finish_reason="abort",
                                    usage={"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}))
        elif command == "cancel":
            if payload in self.engine.sequences:
                last = self.engine.abort(payload)
                if last is not None:
                    self._deliver(last)
        elif command == "abort":
            last = self.engine.abort(payload)
            with self._streams_lock:
                self._streams.pop(payload, None)  # nobody listens any more
            if last is not None and last.usage is not None:
                self._finished(last)

    def _fail_open_requests(self) -> list[Delta]:
        failed = []
        for request_id in list(self.engine.sequences):
            last = None
            try:
                last = self.engine.abort(request_id)
            except Exception:  # the engine's state may be inconsistent; the caller still gets an answer
                log.exception("could not abort %s", request_id)
            usage = last.usage if last is not None and last.usage else {
                "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
            failed.append(Delta(request_id, finish_reason="error", usage=usage))
        return failed

    def _finished(self, last: Delta) -> None:
        if self._finished_hook is not None:
            loop, hook = self._finished_hook
            loop.call_soon_threadsafe(hook, last)

    def _deliver_step(self, deltas: list[Delta]) -> None:
        """One step's deltas: one wakeup of each caller's loop for all of them (not one per delta),
        so every stream of a step is answered in the same turn of that loop, and its channel sends
        them together (workers/wire/outbox.py)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Delta], Delta]]] = {}
        for delta in deltas:
            if delta.usage is not None:
                self._finished(delta)
            with self._streams_lock:
                stream = self._streams.get(delta.request_id)
                if stream is not None and delta.usage is not None:
                    del self._streams[delta.request_id]
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.deltas, delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, delta: Delta) -> None:
        self._deliver_step([delta])


def _put_all(items: list[tuple[asyncio.Queue[Delta], Delta]]) -> None:
    for deltas, delta in items:
        deltas.put_nowait(delta)
