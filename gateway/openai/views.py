"""`POST /v1/chat/completions`, `POST /v1/completions` and `/v1/models`.

A request goes: auth → validate → tokenize → Idempotency-Key (replay?) → quota admission
(prompt + max_tokens reserved) → an `Exchange` to a worker (gateway/upstream/exchange.py), which bills it →
quota settlement to the tokens actually used. Quota headers go on every response of an admitted
or rejected request. Batch lines (a runner's request with `X-Tollway-Batch-Id`, gateway/batches/lines.py)
skip the quotas and run at `batch` priority, metered with their batch id.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from aiohttp import web

from accounting.tenants import AuthRecord
from gateway.api.body import read_json
from gateway.api.errors import ApiError, invalid
from gateway.auth.keys import bearer_token
from gateway.batches.lines import batch_caller
from gateway.billing import idempotency
from gateway.billing.meter import RequestMeter
from gateway.observability.metrics import METRICS
from gateway.observability.request_telemetry import RequestTelemetry
from gateway.observability.tracing import NO_SPAN, TRACING
from gateway.openai.params import GenerationRequest, parse_request
from gateway.openai.responses import ResponseBuilder
from gateway.openai.tokenizer import ChatTemplateError
from gateway.quotas.store import Decision, Limits, QuotaUnavailable
from gateway.state import AUTH, POOL, QUOTAS, SESSIONS
from gateway.upstream.exchange import Exchange
from gateway.upstream.pool import ModelEntry

QUOTA_HEADERS_KEY = web.RequestKey("quota_headers", dict)


def model_entry(app: web.Application, name: str) -> ModelEntry:
    pool = app[POOL]
    entry = pool.models.get(name)
    if entry is not None:
        return entry
    if not pool.models:
        raise ApiError(503, "no engine worker is reachable yet; retry shortly", code="no_worker")
    raise ApiError(404, f"the model '{name}' does not exist; available: {', '.join(sorted(pool.models))}",
                   param="model", code="model_not_found")


def prompt_token_ids(entry: ModelEntry, params: GenerationRequest) -> list[int]:
    if params.messages is not None:
        try:
            return entry.tokenizer.encode_chat(params.messages)
        except ChatTemplateError as exc:
            raise invalid(str(exc), "messages") from exc
    if params.prompt_ids is not None:
        vocab = entry.tokenizer.vocab_size
        if any(t >= vocab for t in params.prompt_ids):
            raise invalid(f"token ids must be below the vocabulary size {vocab}", "prompt")
        return params.prompt_ids
    return entry.tokenizer.encode(params.prompt_text or "")


def completion_budget(entry: ModelEntry, params: GenerationRequest, num_prompt: int) -> int:
    """max_tokens for the worker; a prompt that does not fit the context is a 400 with the numbers."""
    where = "messages" if params.kind == "chat" else "prompt"
    wanted = params.max_tokens if params.max_tokens is not None else 1
    if num_prompt + wanted > entry.context_length:
        raise invalid(
            f"This model's maximum context length is {entry.context_length} tokens. However, you requested "
            f"{num_prompt + wanted} tokens ({num_prompt} in the {where}, {wanted} in the completion). "
            f"Please reduce the length of the {where} or the completion.",
            where, code="context_length_exceeded")
    return params.max_tokens if params.max_tokens is not None else entry.context_length - num_prompt


def worker_body(request_id: str, namespace: str, prompt: list[int], params: GenerationRequest,
                max_tokens: int, priority: str = "interactive") -> dict[str, object]:
    """What the worker gets. A non-streamed request without logprobs asks for the joined answer
    (`"stream": false`: one line per choice at the end, not one per token): the gateway has nothing
    to forward before the end, and a line per token costs it a wakeup and a parse each. Logprobs
    keep the per-token lines, whose texts set the legacy `text_offset`s exactly as when streamed."""
    sampling = {**params.sampling, "max_tokens": max_tokens}
    if params.logprobs is not None:
        sampling["logprobs"] = params.logprobs
    return {"request_id": request_id, "namespace": namespace, "prompt_token_ids": prompt,
            "sampling": sampling, "priority": priority, "stream": params.stream or params.logprobs is not None}


def rejection(reason: str | None, headers: dict[str, str]) -> ApiError:
    if reason == "budget":
        return ApiError(429, "the monthly token budget of this tenant is used up", type="insufficient_quota",
                        code="insufficient_quota", headers=headers)
    what = {"rpm": "requests per minute", "tpm": "tokens per minute",
            "concurrency": "concurrent requests"}.get(reason or "", "rate")
    return ApiError(429, f"rate limit reached: {what}", type="rate_limit_error", code="rate_limit_exceeded",
                    headers=headers)


async def admit(request: web.Request, record: AuthRecord, request_id: str, reserve: int) -> Decision:
    """Charge the tenant's interactive quotas; a 429 (or 503) when they refuse."""
    limits = Limits(record.rpm, record.tpm, record.max_concurrent, record.monthly_token_budget)
    with request.app[TRACING].span("gateway.quota.admit", {"tollway.quota.reserved_tokens": reserve}) as span:
        try:
            decision = await request.app[QUOTAS].admit(f"tenant:{record.tenant_id}", limits, request_id, reserve)
        except QuotaUnavailable as exc:
            request.app[METRICS].rejections.labels(record.tenant_name, "unavailable").inc()
            raise ApiError(503, "quota service unavailable; retry shortly", code="quota_unavailable",
                           headers={"Retry-After": "1"}) from exc
        if span is not None:
            span.set_attribute("tollway.quota.admitted", decision.admitted)
            if decision.reason:
                span.set_attribute("tollway.quota.reason", decision.reason)
    request[QUOTA_HEADERS_KEY] = decision.headers()
    if not decision.admitted:
        request.app[METRICS].rejections.labels(record.tenant_name, decision.reason or "rate").inc()
        raise rejection(decision.reason, decision.headers())
    return decision


async def handle(request: web.Request, kind: Literal["chat", "completion"]) -> web.StreamResponse:
    telemetry = RequestTelemetry.start(request.app)
    try:
        return await _handle(request, kind, telemetry)
    except BaseException as exc:
        telemetry.failed(exc)
        raise
    finally:
        telemetry.finish()


async def _handle(request: web.Request, kind: Literal["chat", "completion"],
                  telemetry: RequestTelemetry) -> web.StreamResponse:
    app = request.app
    tracing = app[TRACING]
    with tracing.span("gateway.auth"):
        batch = await batch_caller(request)  # a batch line from a runner: billed to the batch's tenant
        record: AuthRecord | None = None
        if batch is not None:
            tenant_id, key_id, tenant_name = batch.tenant_id, batch.key_id, batch.tenant_name
        else:
            record = await app[AUTH].authenticate(bearer_token(request))
            tenant_id, key_id, tenant_name = record.tenant_id, record.key_id, record.tenant_name
    telemetry.caller(tenant_name, tenant_id, batch.batch_id if batch else None)
    raw = await read_json(request)
    params = parse_request(kind, raw)
    if batch and params.stream:
        raise invalid("batch requests cannot be streamed: remove 'stream'", "stream")
    entry = model_entry(app, params.model)
    with tracing.span("gateway.tokenize") as span:
        prompt = prompt_token_ids(entry, params)
        max_tokens = completion_budget(entry, params, len(prompt))
        if span is not None:
            span.set_attribute("tollway.request.prompt_tokens", len(prompt))
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    telemetry.request(kind, params, entry.name, request_id, len(prompt), max_tokens, raw)

    with tracing.span("gateway.idempotency") if idempotency.HEADER in request.headers else NO_SPAN:
        claim = await idempotency.claim_or_replay(request, app[SESSIONS], tenant_id, raw, request_id)
    if isinstance(claim, idempotency.Replay):
        return claim.response()
    decision = None
    if record is not None:  # batch lines skip the interactive quotas (see gateway/batches/lines.py)
        try:
            decision = await admit(request, record, request_id, len(prompt) + max_tokens * params.n)
        except BaseException:
            if claim is not None:
                await idempotency.release(app[SESSIONS], claim)
            raise

    namespace = f"tenant-{tenant_id}"  # set here, from the key or batch: clients never choose it
    meter = RequestMeter(request_id, tenant_id, key_id, entry.name, len(prompt),
                         batch_id=batch.batch_id if batch else None)
    telemetry.meter = meter
    exchange = Exchange(request, params, entry.name, namespace, prompt,
                        worker_body(request_id, namespace, prompt, params, max_tokens,
                                    "batch" if batch else "interactive"),
                        ResponseBuilder(kind, request_id, entry.name, int(time.time()), entry.tokenizer,
                                        params.logprobs is not None),
                        meter, claim if isinstance(claim, idempotency.Claim) else None, telemetry.tenant)
    in_flight = app[METRICS].in_flight.labels(entry.name)
    in_flight.inc()
    try:
        return await (exchange.respond_stream() if params.stream else exchange.respond_json())
    finally:
        in_flight.dec()
        if decision is not None:
            with tracing.span("gateway.quota.settle"):
                await app[QUOTAS].settle(decision.ticket, meter.total_tokens())
        if claim is not None:  # a no-op when the response was stored with the usage row
            await idempotency.release(app[SESSIONS], claim)


async def add_quota_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the x-ratelimit-* headers go on every response of an admitted request."""
    headers = request.get(QUOTA_HEADERS_KEY)
    if headers:
        for name, value in headers.items():
            response.headers.setdefault(name, value)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """Create a chat completion (OpenAI-compatible; SSE when `stream` is true)."""
    return await handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    """Create a text completion (OpenAI-compatible; SSE when `stream` is true)."""
    return await handle(request, "completion")


async def list_models(request: web.Request) -> web.Response:
    """List the models served by the workers in rotation."""
    await request.app[AUTH].authenticate(bearer_token(request))
    data = [model_object(name) for name in sorted(request.app[POOL].models)]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    """One model."""
    await request.app[AUTH].authenticate(bearer_token(request))
    return web.json_response(model_object(model_entry(request.app, request.match_info["model"]).name))


def model_object(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tollway"}
