"""Carrying one admitted request to a worker and its answer back to the client, metered.

An `Exchange` owns one request after admission: it opens a worker stream (trying other workers
while nothing has been streamed), turns worker lines into OpenAI responses, and bills the request
exactly once through its `RequestMeter`, durably before the client's final byte. Failure rules:
- a non-streamed request whose worker is lost midway is retried elsewhere (nothing reached the
  client; the lost attempt's tokens are not billed);
- a stream whose worker is lost midway ends with an OpenAI error event, billed for what was
  streamed (status `upstream_error`);
- a client that hangs up before the end: the worker is told to cancel, its final line gives the
  exact usage so far, billed with status `client_disconnected` (by a background task the app
  owns and awaits at shutdown: aiohttp may cancel the handler itself).

Lines are taken in batches (every line that arrived since the last read): a stream writes the SSE
events of one batch in one write, so a client behind a busy loop gets several tokens per write
instead of a write (and a wakeup) per token; the final line's events go out in a write of their
own, after the usage row is committed, so the tokens before it never wait for that commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.billing.idempotency import Claim
from gateway.billing.meter import RequestMeter
from gateway.observability.metrics import METRICS
from gateway.observability.tracing import TRACING
from gateway.openai.params import GenerationRequest
from gateway.openai.sse import SSE_HEADERS, sse
from gateway.state import BACKGROUND, POOL, ROUTER, SETTINGS, WRITER
from gateway.upstream.stream import UpstreamBroken, UpstreamRejected, UpstreamStream, UpstreamUnavailable
from workers.wire.generate import GenerateBody

DRAIN_TIMEOUT_S = 10.0


class Builder(Protocol):
    """Turns a request's worker lines into its API's answer: one JSON object, or SSE bytes
    (chat / completions: gateway/openai/responses.py; Responses: gateway/openai/responses_api.py)."""

    choices: Any  # cleared when a non-streamed request starts over on another worker

    def absorb(self, delta: dict[str, Any]) -> Any: ...
    def final(self, usage: dict[str, int]) -> dict[str, Any]: ...
    def stream_start(self) -> bytes: ...
    def stream_line(self, line: dict[str, Any]) -> bytes: ...
    def stream_end(self, usage: dict[str, int], include_usage: bool) -> bytes: ...


def _failed(line: dict[str, Any]) -> bool:
    return line.get("finish_reason") in ("error", "abort")


@dataclass
class Exchange:
    request: web.Request
    params: GenerationRequest
    model: str
    namespace: str
    prompt: list[int]
    body: GenerateBody  # what the worker gets
    builder: Builder
    meter: RequestMeter
    claim: Claim | None
    tenant: str = "-"  # the metrics' tenant label

    async def open(self) -> tuple[str, list[dict[str, Any]], UpstreamStream]:
        """(worker url, first lines, the rest): tries other workers until one starts streaming."""
        app = self.request.app
        pool, router = app[POOL], app[ROUTER]
        tried: set[str] = set()
        for _ in range(app[SETTINGS].max_attempts):
            loads = pool.loads(self.model, exclude=tried)
            if not loads:
                break
            with app[TRACING].span("gateway.route", {"tollway.route.candidates": len(loads)}) as span:
                # One worker configured: no choice to make, and no other worker its prefixes could steer.
                url = next(iter(loads)) if len(pool.workers) == 1 else router.choose(self.namespace, self.prompt, loads)
                if span is not None:
                    span.set_attribute("tollway.worker.url", url)
            stream = pool.stream(url, self.body)
            try:
                first = await stream.next_lines()
                if first is not None:
                    return url, first, stream
                tried.add(url)
            except UpstreamUnavailable:
                tried.add(url)
                router.forget_worker(url)
            except UpstreamRejected as exc:
                await stream.aclose()
                raise ApiError(400, exc.message) from exc
            except asyncio.CancelledError:  # the client left before the first token: stop and bill
                self._hand_off(url, stream)
                raise
            await stream.aclose()
        raise ApiError(503, f"no engine worker for '{self.model}' could take the request; retry shortly",
                       code="no_worker", headers={"Retry-After": "1"})

    async def _bill(self, status: str, url: str, response: tuple[int, str, bytes] | None = None) -> None:
        """Write the usage row (durable before the client's last byte), then tell the worker it may
        forget the request's usage (it keeps it until then, in case this gateway dies)."""
        app = self.request.app
        with app[TRACING].span("gateway.metering.commit", {"tollway.usage.status": status}):
            # Alone in this process: commit on the loop thread (nothing else waits on it) instead of two
            # thread handoffs to the writer and back; with company, the writer's group commit.
            alone = app[METRICS].answering <= 1
            await self.meter.finish(app[WRITER], status, self.claim if response else None, response, inline=alone)
        app[POOL].acknowledge(url, self.body["request_id"])
        meter = self.meter
        # After the response's last write (this loop turn's): metrics are not worth the client's wait.
        asyncio.get_running_loop().call_soon(app[METRICS].billed, self.tenant, self.model, meter.usage_so_far(),
                                             meter.ttft_s(), meter.inter_token_s())

    # -- non-streamed -------------------------------------------------------------------------------
    async def respond_json(self) -> web.Response:
        for _ in range(self.request.app[SETTINGS].max_attempts):
            url, first, lines = await self.open()
            try:
                return await self._collect(url, first, lines)
            except UpstreamBroken:  # nothing reached the client: start over on another worker
                self.request.app[POOL].acknowledge(url, self.body["request_id"])  # that attempt is not billed
                self.builder.choices.clear()
                self.meter.restart()
        raise ApiError(502, "engine workers failed mid-request on every attempt; retry later", code="worker_failed")

    async def _collect(self, url: str, first: list[dict[str, Any]], stream: UpstreamStream) -> web.Response:
        lines: list[dict[str, Any]] | None = first
        handed_off = False
        try:
            while lines is not None:
                for line in lines:
                    self.meter.observe(line)
                    if _failed(line):
                        await self._bill("upstream_error", url)
                        raise ApiError(502, "the engine failed while generating; retry the request",
                                       code="engine_error")
                    self.builder.absorb(line)
                    if "usage" in line:
                        body = orjson.dumps(self.builder.final(line["usage"]))
                        await self._bill("ok", url, (200, "application/json", body))
                        return web.Response(body=body, content_type="application/json")
                lines = await stream.next_lines()
        except asyncio.CancelledError:  # the client hung up (aiohttp cancels the handler)
            handed_off = self._hand_off(url, stream)
            raise
        finally:
            if not handed_off:
                await stream.aclose()
        raise UpstreamBroken("the engine worker ended the request without a result")

    # -- streamed -------------------------------------------------------------------------------------
    async def respond_stream(self) -> web.StreamResponse:
        url, first, stream = await self.open()
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(self.request)
        transcript: list[bytes] = []  # what the client got: stored for Idempotency-Key replays
        start = self.builder.stream_start()  # the opening events (the Responses API's), before the first line
        lines: list[dict[str, Any]] | None = first
        handed_off = False
        try:
            while lines is not None:
                chunks: list[bytes] = []
                ended = False
                for line in lines:
                    self.meter.observe(line)
                    if _failed(line):
                        if chunks:  # what came before the failure still reaches the client
                            await response.write(b"".join(chunks))
                        raise UpstreamBroken("the engine failed while generating")
                    chunk, start = start + self.builder.stream_line(line), b""
                    if "usage" in line:
                        chunk += self.builder.stream_end(line["usage"], self.params.include_usage)
                    chunks.append(chunk)
                    if ended := "usage" in line:
                        break
                final = chunks.pop() if ended else None
                if chunks:  # the tokens before the last line reach the client now, not after the commit
                    chunk = b"".join(chunks)
                    transcript.append(chunk)
                    await response.write(chunk)
                if final is not None:
                    transcript.append(final)
                    # Billed (with its stored response) before the client can see the end.
                    await self._bill("ok", url, (200, SSE_HEADERS["Content-Type"], b"".join(transcript)))
                    await response.write(final)
                    break
                lines = await stream.next_lines()
            else:
                raise UpstreamBroken("the engine worker ended the stream early")
        except UpstreamBroken as exc:
            await self._bill("upstream_error", url)
            error = ApiError(502, f"the engine worker failed mid-stream: {exc}", code="worker_failed")
            with contextlib.suppress(ConnectionResetError):
                await response.write(sse(error.body()))
        except ConnectionResetError:  # the client hung up, seen on a write
            handed_off = self._hand_off(url, stream)
            return response
        except asyncio.CancelledError:  # the client hung up, and aiohttp cancels the handler
            handed_off = self._hand_off(url, stream)
            raise
        finally:
            if not handed_off:
                await stream.aclose()
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    def _hand_off(self, url: str, stream: UpstreamStream) -> bool:
        """The client is gone: a background task (owned by the app) now owns `stream` and bills."""
        tasks = self.request.app[BACKGROUND]
        task = asyncio.get_running_loop().create_task(self._after_hangup(url, stream))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return True

    async def _after_hangup(self, url: str, stream: UpstreamStream) -> None:
        """Ask the worker to stop, read on to its final line (the exact usage), bill the request."""
        try:
            await self.request.app[POOL].cancel(url, self.body["request_id"])
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                while (lines := await stream.next_lines()) is not None:
                    for line in lines:
                        self.meter.observe(line)
        except (TimeoutError, UpstreamBroken):
            pass  # billed from the tokens received so far
        finally:
            await stream.aclose()
        await self._bill("client_disconnected", url)
