"""What one completion request reports when it ends: its server span's attributes and its metrics.

Attributes follow the OpenTelemetry GenAI conventions (`gen_ai.*`) plus `tollway.*`. The prompt
goes into the span only with TOLLWAY_TRACE_PROMPTS (truncated); keys never do. Tokens are
counted where they are billed (`GatewayMetrics.billed`, from the Exchange); this object counts
the request itself, with its final status, once.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from opentelemetry.trace import Span

from gateway.api.errors import ApiError
from gateway.billing.meter import RequestMeter
from gateway.observability.metrics import BILLED_STATUS_CODES, METRICS, UNKNOWN, GatewayMetrics
from gateway.observability.tracing import TRACING
from gateway.openai.params import GenerationRequest

GEN_AI_OPERATIONS = {"chat": "chat", "completion": "text_completion"}
MAX_PROMPT_CHARS = 16_384


@dataclass
class RequestTelemetry:
    metrics: GatewayMetrics
    span: Span | None  # the request's SERVER span when traced
    record_prompts: bool = False
    t0: float = field(default_factory=time.perf_counter)
    tenant: str = UNKNOWN
    model: str = UNKNOWN
    status: str | None = None  # set by `failed`; else from the meter or 200
    meter: RequestMeter | None = None  # once the request was admitted

    @classmethod
    def start(cls, app: web.Application) -> RequestTelemetry:
        tracing = app[TRACING]
        return cls(app[METRICS], tracing.current(), tracing.record_prompts)

    def caller(self, tenant_name: str, tenant_id: int, batch_id: str | None) -> None:
        self.tenant = tenant_name or str(tenant_id)
        if self.span is not None:
            self.span.set_attribute("tollway.tenant.id", tenant_id)
            self.span.set_attribute("tollway.tenant.name", self.tenant)
            if batch_id is not None:
                self.span.set_attribute("tollway.batch.id", batch_id)

    def request(self, kind: str, params: GenerationRequest, model: str, request_id: str, prompt_tokens: int,
                max_tokens: int, raw: dict[str, Any]) -> None:
        self.model = model
        if self.span is None:
            return
        operation = GEN_AI_OPERATIONS[kind]
        self.span.update_name(f"{operation} {model}")
        self.span.set_attributes({
            "gen_ai.operation.name": operation, "gen_ai.provider.name": "tollway", "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": max_tokens, "tollway.request.id": request_id,
            "tollway.request.prompt_tokens": prompt_tokens, "tollway.request.stream": params.stream,
            "gen_ai.request.choice.count": params.n})
        if params.sampling.get("temperature") is not None:
            self.span.set_attribute("gen_ai.request.temperature", float(params.sampling["temperature"]))
        if self.record_prompts:
            key, value = ("gen_ai.input.messages", params.messages) if kind == "chat" else \
                ("gen_ai.prompt", raw.get("prompt"))  # chat and Responses alike: the messages as parsed
            self.span.set_attribute(key, orjson.dumps(value).decode()[:MAX_PROMPT_CHARS])

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, ApiError):
            self.status = str(exc.status)
        elif isinstance(exc, asyncio.CancelledError | ConnectionResetError):
            self.status = "499"
        else:
            self.status = "500"

    def finish(self) -> None:
        meter, status = self.meter, self.status
        if status is None:
            status = BILLED_STATUS_CODES.get(meter.status or "", "200") if meter is not None else "200"
        # Counted after the response's last write (this loop turn's): not worth the client's wait.
        asyncio.get_running_loop().call_soon(self.metrics.request_finished, self.tenant, self.model, status,
                                             time.perf_counter() - self.t0)
        if self.span is None or meter is None or not meter.started:
            return
        usage = meter.usage_so_far()
        self.span.set_attributes({
            "gen_ai.usage.input_tokens": usage["prompt_tokens"],
            "gen_ai.usage.output_tokens": usage["completion_tokens"],
            "tollway.cache.cached_tokens": usage["cached_tokens"],
            "gen_ai.response.finish_reasons": [meter.finish_reasons[i] for i in sorted(meter.finish_reasons)],
            "gen_ai.response.id": meter.request_id, "tollway.usage.status": meter.status or "unbilled"})
        ttft = meter.ttft_s()
        if ttft is not None:
            self.span.set_attribute("tollway.ttft_ms", round(ttft * 1e3, 3))


TELEMETRY = web.RequestKey("request_telemetry", RequestTelemetry)


def observed(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
             ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Wrap a generation view: its `RequestTelemetry` (request[TELEMETRY]) sees every outcome,
    refusals by the guard inside included, and reports once when the view ends."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        telemetry = request[TELEMETRY] = RequestTelemetry.start(request.app)
        try:
            return await handler(request)
        except BaseException as exc:
            telemetry.failed(exc)
            raise
        finally:
            telemetry.finish()

    return wrapped
