"""The worker's internal HTTP API for the gateway (aiohttp).

POST /internal/generate  JSON {request_id, namespace, prompt_token_ids, sampling, priority[, stream][, weight]}
                         -> NDJSON deltas {index, token_ids, text, finish_reason[, logprobs]
                         [, prompt_logprobs]} (workers/wire/generate.py)
                         (index = choice, for n > 1); the request's last line adds usage
                         {prompt_tokens, cached_tokens, completion_tokens}. With "stream": false
                         the deltas come at the end, one joined line per choice plus `decode_s`
                         (workers/wire/generate.py LineJoiner). A closed connection aborts the request.
GET  /internal/channel   a websocket carrying many generate requests at once, the same answers
                         in frames (workers/server/channel.py): the gateway's transport to its workers
POST /internal/requests/{id}/cancel  stop a request; its stream ends with an "abort" line that
                         still carries usage (so a client that went away is billed exactly)
GET  /internal/info      model, context length, block size, blocks, cache stats, queue lengths
GET  /internal/tokenizer the model's tokenizer files, so the gateway tokenizes without the model:
                         {model, tokenizer_json, tokenizer_config, chat_template}
GET  /internal/traces?trace_id=…  this worker's finished spans of those traces (when tracing is on)
GET  /healthz            liveness
GET  /metrics            Prometheus text format (workers/server/metrics.py)

The door (workers/server/auth.py): every /internal/* route answers 401 without the gateway's
credential, `Authorization: Bearer <workers' shared secret>` (the channel before its upgrade);
/healthz and /metrics are open. The secret is what makes the gateway the only caller, and so the
only one that sets a request's `namespace`: a client can never pick another tenant's cache
namespace, because no client can reach this API. Bind it to 127.0.0.1 or a private network.
With tracing on, a generate call's `traceparent` header (or a channel frame's) makes its
`worker.generate` span (and the engine's phase spans under it) part of the caller's trace.
Bad input answers 400 with {"error": {"message", "type"}}; never a 500 for a caller's mistake.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from opentelemetry.trace import Span, SpanKind, set_span_in_context
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from workers.engine.async_engine import AsyncEngine
from workers.engine.phase_spans import TraceParent
from workers.engine.request import Priority
from workers.models.tokenizer import tokenizer_payload
from workers.server.auth import internal_auth
from workers.server.billing import BILLING_KEY, setup_billing
from workers.server.channel import serve_channel, setup_channels
from workers.server.errors import error
from workers.server.ledger import UsageLedger
from workers.server.metrics import WorkerMetrics, make_metrics
from workers.tracing import WorkerTracing
from workers.wire.generate import MAX_BODY_BYTES, GenerateRequest, LineJoiner, ndjson, parse_generate
from workers.wire.telemetry import PROPAGATOR

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
METRICS_KEY = web.AppKey("metrics", WorkerMetrics)
TRACING_KEY = web.AppKey("tracing", WorkerTracing)  # absent when tracing is off
MAX_TRACE_IDS = 64


def _start_span(app: web.Application, parsed: GenerateRequest,
                headers: Mapping[str, str]) -> tuple[Span | None, TraceParent | None]:
    tracing = app.get(TRACING_KEY)
    if tracing is None:
        return None, None
    span = tracing.tracer.start_span("worker.generate", context=PROPAGATOR.extract(headers),
                                     kind=SpanKind.SERVER, attributes={
                                         "gen_ai.operation.name": "generate",
                                         "gen_ai.request.model": app[ENGINE_KEY].engine.name,
                                         "gen_ai.request.max_tokens": parsed.params.max_tokens,
                                         "tollway.request.id": parsed.request_id,
                                         "tollway.priority": parsed.priority,
                                         "tollway.request.prompt_tokens": len(parsed.prompt)})
    return span, TraceParent(set_span_in_context(span), time.time_ns())


@dataclass
class _Outcome:
    """What a generate stream reported, for its span."""

    finish_reasons: dict[int, str] = field(default_factory=dict)  # by choice index
    usage: dict[str, int] | None = None
    speculative: dict[str, int] | None = None  # when the engine speculates: drafted / accepted tokens


def _end_span(span: Span, outcome: _Outcome) -> None:
    if outcome.usage is not None:
        span.set_attributes({"gen_ai.usage.input_tokens": outcome.usage["prompt_tokens"],
                             "gen_ai.usage.output_tokens": outcome.usage["completion_tokens"],
                             "tollway.cache.cached_tokens": outcome.usage["cached_tokens"]})
    if outcome.speculative is not None:
        span.set_attributes({"tollway.speculative.drafted_tokens": outcome.speculative["drafted_tokens"],
                             "tollway.speculative.accepted_tokens": outcome.speculative["accepted_tokens"]})
    reasons = outcome.finish_reasons
    span.set_attribute("gen_ai.response.finish_reasons", [reasons[i] for i in sorted(reasons)])
    span.end()


def _line(delta: Any, metrics: WorkerMetrics, outcome: _Outcome) -> dict[str, Any]:
    """One engine delta as a protocol line; counts what it finished."""
    line = {"index": delta.index, "token_ids": delta.token_ids, "text": delta.text,
            "finish_reason": delta.finish_reason}
    if delta.logprobs is not None:
        line["logprobs"] = delta.logprobs
        line["top_logprobs"] = [[[t, lp] for t, lp in top] for top in delta.top_logprobs or []]
    if delta.prompt_logprobs is not None:
        line["prompt_logprobs"] = delta.prompt_logprobs
        line["prompt_top_logprobs"] = [[[t, lp] for t, lp in top] for top in delta.prompt_top_logprobs or []]
    if delta.usage is not None:
        line["usage"] = outcome.usage = delta.usage
        metrics.prompt_tokens.inc(delta.usage["prompt_tokens"])
        metrics.cached_tokens.inc(delta.usage["cached_tokens"])
        metrics.completion_tokens.inc(delta.usage["completion_tokens"])
    if delta.speculative is not None:
        outcome.speculative = delta.speculative
    if delta.finish_reason is not None:
        outcome.finish_reasons[delta.index] = delta.finish_reason
        metrics.finished.labels(reason=delta.finish_reason).inc()
    return line


async def answer(app: web.Application, body: Any, headers: Mapping[str, str], owner: object | None = None,
                 hung_up: Callable[[], bool] = lambda: False) -> AsyncGenerator[list[dict[str, Any]], None]:
    """The answer to one generate body, in batches of lines to send together: one line per batch
    when streamed; when not, an empty batch once it runs, then every joined line in one batch at
    the end. Raises ValueError (a 400) before its first batch for a bad request. Closing it early
    aborts the request in the engine; `hung_up` tells a joined answer, which writes nothing until
    the end, that its caller left. A billed request's usage is kept for `owner` (its channel) to
    acknowledge, however it ends (workers/server/billing.py)."""
    parsed = parse_generate(body)
    span, trace = _start_span(app, parsed, headers)
    outcome = _Outcome()
    billing = app[BILLING_KEY]
    billing.started(parsed.request_id, parsed.billing, owner)
    submitted = False  # from the first anext on, the engine reports the request's end to `billing`
    try:
        stream = app[ENGINE_KEY].generate(parsed.request_id, parsed.prompt, parsed.params, parsed.namespace,
                                          Priority[parsed.priority.upper()], trace, parsed.weight)
        try:
            submitted = True
            try:
                delta = await anext(stream)  # validation errors surface here, before any byte is sent
            except ValueError:
                submitted = False
                raise
            joiner = None if parsed.stream else LineJoiner()
            accepted = False
            while True:
                line = _line(delta, app[METRICS_KEY], outcome)
                if joiner is None:
                    yield [line]
                else:
                    joiner.add(line, time.perf_counter())
                    if not accepted:
                        accepted = True
                        yield []  # validated and running: an HTTP caller gets its headers now
                if delta.usage is not None:  # the request's last line: every choice has finished
                    break
                if joiner is not None and hung_up():
                    return
                delta = await anext(stream)
            if joiner is not None:
                yield joiner.lines()
        finally:
            await stream.aclose()  # before the end, this aborts the request
    finally:
        if not submitted:
            billing.refused(parsed.request_id)
        if span is not None:
            _end_span(span, outcome)


async def generate(request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json(loads=orjson.loads)
    except (orjson.JSONDecodeError, UnicodeDecodeError):
        return error(400, "the body is not valid JSON")
    lines = answer(request.app, body, request.headers,
                   hung_up=lambda: request.transport is None or request.transport.is_closing())
    try:
        batch: list[dict[str, Any]] | None = await anext(lines)
    except ValueError as exc:
        return error(400, str(exc))
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    try:
        await response.prepare(request)
        while batch is not None:
            if batch:
                await response.write(ndjson(batch))
            batch = await anext(lines, None)
    except ConnectionResetError:  # the caller hung up: nothing more to send
        return response
    finally:
        await lines.aclose()  # on a closed connection this aborts the request
    await response.write_eof()
    return response


async def channel(request: web.Request) -> web.WebSocketResponse:
    """Many generate requests over one websocket (the gateway's transport; workers/server/channel.py)."""
    app = request.app
    return await serve_channel(request, lambda body, headers, owner: answer(app, body, headers, owner),
                               app[ENGINE_KEY].cancel, app[BILLING_KEY])


async def cancel(request: web.Request) -> web.Response:
    """Stop a request; its open stream ends with an 'abort' line carrying the usage so far."""
    request.app[ENGINE_KEY].cancel(request.match_info["request_id"])
    return web.json_response({"status": "cancelling"}, status=202)


async def info(request: web.Request) -> web.Response:
    """The engine's state, and the usage ledger's counts (`usage_ledger.orphans` > 0: bill them)."""
    info = {**request.app[ENGINE_KEY].info(), "usage_ledger": request.app[BILLING_KEY].info()}
    return web.json_response(info, dumps=lambda o: json.dumps(o, default=str))


async def tokenizer(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY].engine
    payload = {"model": engine.name, **tokenizer_payload(engine.loaded.folder)}
    # stdlib json: tokenizer configs hold integers beyond 64 bits (model_max_length = 1e30)
    return web.Response(text=json.dumps(payload), content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[METRICS_KEY].registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def traces(request: web.Request) -> web.Response:
    """This worker's finished spans of the given traces (`trace_id` repeated, at most 64)."""
    trace_ids = request.query.getall("trace_id", [])
    if len(trace_ids) > MAX_TRACE_IDS:
        return error(400, f"at most {MAX_TRACE_IDS} trace_id parameters")
    tracing = request.app.get(TRACING_KEY)
    spans = tracing.recent.for_traces(trace_ids) if tracing is not None and tracing.recent is not None else []
    return web.json_response({"spans": spans}, dumps=lambda o: orjson.dumps(o).decode())


def create_worker_app(engine: AsyncEngine, tracing: WorkerTracing | None = None, *, secret: str,
                      ledger_path: Path | None = None) -> web.Application:
    """`tracing`: the worker's tracer (the engine was built with the same one), or None (off);
    `secret`: the workers' shared secret every /internal/* call must present; `ledger_path`: where
    unacknowledged usage is kept across restarts (None: in memory only)."""
    if not secret:
        raise ValueError("a worker needs a non-empty secret")
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[internal_auth(lambda: secret)])
    app[ENGINE_KEY] = engine
    billing = setup_billing(app, UsageLedger(ledger_path))

    async def finished_hook(app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        engine.set_finished_hook(loop, lambda last: billing.finished(last.request_id, last.usage or {},
                                                                     last.finish_reason))

    app.on_startup.append(finished_hook)
    app[METRICS_KEY] = make_metrics(engine.info)
    if tracing is not None:
        app[TRACING_KEY] = tracing
    app.router.add_post("/internal/generate", generate)
    app.router.add_get("/internal/channel", channel)
    setup_channels(app)
    app.router.add_post("/internal/requests/{request_id}/cancel", cancel)
    app.router.add_get("/internal/info", info)
    app.router.add_get("/internal/tokenizer", tokenizer)
    app.router.add_get("/internal/traces", traces)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app
