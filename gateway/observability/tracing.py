"""The gateway's spans: one SERVER span per API request (the middleware), child spans per step.

Off (the default) costs a dict lookup and a shared null context per step: no span objects, no
context switches, no header. On, each /v1 and /admin/v1 request is traced; a `traceparent` from
the caller (e.g. a batch runner) continues the caller's trace. Span names:
  POST /v1/chat/completions → renamed "chat MODEL" / "text_completion MODEL" once parsed (GenAI)
    gateway.auth, gateway.tokenize, gateway.idempotency, gateway.quota.admit, gateway.route,
    gateway.worker.generate (CLIENT; worker_pool.py, carries `traceparent`), gateway.metering.commit,
    gateway.quota.settle
API keys are never recorded; the prompt only with TOLLWAY_TRACE_PROMPTS.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from workers.wire.telemetry import PROPAGATOR, RecentSpans, TracingSettings, build_tracer_provider

TRACED_PREFIXES = ("/v1/", "/admin/v1/")  # not /metrics, /healthz or the dashboard polling itself
NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()
"""What `GatewayTracing.span` returns when tracing is off (shared: it holds no state)."""


@dataclass
class GatewayTracing:
    tracer: Tracer | None = None  # None: tracing is off
    recent: RecentSpans | None = None
    record_prompts: bool = False
    provider: TracerProvider | None = None

    def span(self, name: str, attributes: dict[str, Any] | None = None) -> contextlib.AbstractContextManager[Span | None]:
        """A leaf child of the current span around the block; `None` (and nothing made) when off.

        Leaf: it is not made current (no context switch), so nothing may be traced inside it."""
        if self.tracer is None:
            return NO_SPAN
        return _LeafSpan(self.tracer, name, attributes)

    def current(self) -> Span | None:
        """The current span when tracing is on and one is recording."""
        if self.tracer is None:
            return None
        span = trace.get_current_span()
        return span if span.is_recording() else None


class _LeafSpan:
    """The cheapest span around a block: started on entry, ended on exit, an error status when it raises."""

    __slots__ = ("_attributes", "_name", "_span", "_tracer")

    def __init__(self, tracer: Tracer, name: str, attributes: dict[str, Any] | None) -> None:
        self._tracer, self._name, self._attributes = tracer, name, attributes

    def __enter__(self) -> Span:
        self._span = self._tracer.start_span(self._name, attributes=self._attributes)
        return self._span

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _traceback: object) -> None:
        if isinstance(error, Exception):
            self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:200]))
        self._span.end()


TRACING = web.AppKey("tracing", GatewayTracing)


def gateway_tracing(settings: TracingSettings) -> GatewayTracing:
    """Off unless TOLLWAY_TRACING or TOLLWAY_OTLP_ENDPOINT is set (tests build their own around an
    in-memory exporter and hand it to `create_app`)."""
    if not settings.tracing_enabled:
        return GatewayTracing(record_prompts=settings.trace_prompts)
    provider, recent = build_tracer_provider("tollway-gateway", settings)
    return GatewayTracing(provider.get_tracer("tollway.gateway"), recent, settings.trace_prompts, provider)


def setup_tracing(app: web.Application, tracing: GatewayTracing, *, owned: bool) -> None:
    app[TRACING] = tracing

    async def flush(app: web.Application) -> AsyncIterator[None]:
        yield
        if owned and tracing.provider is not None:
            tracing.provider.shutdown()  # flushes the OTLP queue

    app.cleanup_ctx.append(flush)


@web.middleware
async def tracing_middleware(request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Only installed when tracing is on; placed outside the error middleware, so it sees final statuses."""
    tracer = request.app[TRACING].tracer
    if tracer is None or not request.path.startswith(TRACED_PREFIXES):
        return await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    attributes = {"http.request.method": request.method, "http.route": route, "url.path": request.path}
    with tracer.start_as_current_span(f"{request.method} {route}", context=PROPAGATOR.extract(request.headers),
                                      kind=SpanKind.SERVER, attributes=attributes, record_exception=False,
                                      set_status_on_exception=False) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        return response
