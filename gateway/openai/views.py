"""`POST /v1/chat/completions` and `POST /v1/completions`: the request pipeline, stage by stage.

    authenticate  gateway/auth/guards.py       tenant key, or a batch runner's line
    parse         gateway/openai/prompt.py     body → params → model → prompt tokens → budget
    replay?       gateway/billing/idempotency.py   Idempotency-Key: claim it, or answer the stored response
    admit         gateway/quotas/admission.py  reserve prompt + max_tokens × n (429 when refused)
    exchange      gateway/upstream/exchange.py a worker's answer to the client, metered exactly once
    meter         gateway/billing/meter.py     (inside the exchange: durable before the final byte)
    settle        gateway/quotas/admission.py  quotas corrected to the tokens used

Quota headers go on every response of an admitted or refused request. Batch lines skip the
quotas and run at `batch` priority, metered with their batch id.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from gateway.auth.guards import CALLER, tenant_or_batch_line
from gateway.billing import idempotency
from gateway.billing.meter import RequestMeter
from gateway.observability.metrics import METRICS
from gateway.observability.request_telemetry import TELEMETRY, observed
from gateway.observability.tracing import NO_SPAN, TRACING
from gateway.openai.params import GenerationKind
from gateway.openai.prompt import ParsedGeneration, namespace_of, parse_generation, worker_body
from gateway.openai.responses import EchoedPrompt, ResponseBuilder
from gateway.openai.responses_api import ResponsesBuilder, parse_responses
from gateway.quotas.admission import admit
from gateway.upstream.exchange import Exchange


@observed
@tenant_or_batch_line
async def chat_completions(request: web.Request) -> web.StreamResponse:
    """Create a chat completion (OpenAI-compatible; SSE when `stream` is true)."""
    return await generation(request, "chat", "chat.completions")


@observed
@tenant_or_batch_line
async def completions(request: web.Request) -> web.StreamResponse:
    """Create a text completion (OpenAI-compatible; SSE when `stream` is true)."""
    return await generation(request, "completion", "completions")


@observed
@tenant_or_batch_line
async def responses(request: web.Request) -> web.StreamResponse:
    """Create a model response (OpenAI Responses API, stateless; SSE events when `stream` is true)."""
    return await generation(request, "chat", "responses")


def _builder(route: str, parsed: ParsedGeneration, created: int) -> Any:
    params, entry = parsed.params, parsed.entry
    tools = params.tools is not None and params.tools.active
    if route == "responses":
        raw = parsed.raw
        echo = {name: raw[name] for name in ("instructions", "max_output_tokens", "temperature", "top_p", "tools",
                                             "tool_choice", "parallel_tool_calls", "text", "user") if name in raw}
        return ResponsesBuilder(parsed.request_id, entry.name, created, echo, tools=tools)
    kind: GenerationKind = "chat" if route == "chat.completions" else "completion"
    echoed = None
    if params.echo:  # the prompt as sent; token ids decoded
        text = params.prompt_text if params.prompt_text is not None else entry.tokenizer.decode(
            parsed.prompt, skip_special_tokens=False)
        echoed = EchoedPrompt(text, parsed.prompt)
    return ResponseBuilder(kind, parsed.request_id, entry.name, created, entry.tokenizer, params.logprobs is not None,
                           tools=tools, echo=echoed)


async def generation(request: web.Request, kind: GenerationKind, route: str) -> web.StreamResponse:
    """The pipeline of every generation route (`route`: chat.completions | completions | responses,
    as usage rows record it)."""
    app, caller, telemetry = request.app, request[CALLER], request[TELEMETRY]
    telemetry.caller(caller.tenant_name, caller.tenant_id, caller.batch_id)

    parsed = await parse_generation(request, kind, caller, parse_responses if route == "responses" else None)
    params, entry = parsed.params, parsed.entry
    telemetry.request(kind, params, entry.name, parsed.request_id, len(parsed.prompt), parsed.max_tokens,
                      parsed.raw)

    with app[TRACING].span("gateway.idempotency") if idempotency.HEADER in request.headers else NO_SPAN:
        claim = await idempotency.claim_or_replay(request, caller.tenant_id, parsed.raw, parsed.request_id)
    if isinstance(claim, idempotency.Replay):
        return claim.response()
    try:
        admission = await admit(request, caller, parsed.request_id, parsed.reserved_tokens)
        meter = telemetry.meter = RequestMeter(parsed.request_id, caller.tenant_id, caller.key_id, entry.name,
                                               len(parsed.prompt), batch_id=caller.batch_id, route=route)
        exchange = Exchange(request, params, entry.name, namespace_of(caller), parsed.prompt,
                            worker_body(parsed, caller, meter.started_at, route),
                            _builder(route, parsed, int(time.time())), meter, claim, telemetry.tenant)
        metrics = app[METRICS]
        in_flight = metrics.in_flight_of(entry.name)
        in_flight.inc()
        metrics.answering += 1
        try:
            return await (exchange.respond_stream() if params.stream else exchange.respond_json())
        finally:
            in_flight.dec()
            metrics.answering -= 1
            await admission.settle(meter.total_tokens())
    finally:
        if claim is not None:  # a no-op when the response was stored with the usage row
            await idempotency.release(request, claim)
