"""OpenTelemetry plumbing of every tollway process: tracing settings, a process's tracer provider
(the dashboard's ring buffer of finished spans, OTLP/HTTP export when set) and the W3C propagator
that carries `traceparent` across every internal call, channel frame and batch task.

One copy for both sides: the gateway imports it from here (workers.wire is the only part of
`workers/` it may import). Nothing is global: each app gets its own provider (tests build several
in one process). Creating the exporter connects to nothing; spans are sent from the batch
processor's thread.
"""

from __future__ import annotations

import os
import socket
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TracingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOLLWAY_", extra="ignore")

    tracing: bool = False
    """Record spans (kept in an in-process ring buffer for /admin/dashboard); implied by otlp_endpoint.
    Off: no span is created anywhere (near-zero cost)."""
    otlp_endpoint: str | None = None
    """OTLP/HTTP collector, e.g. http://otel-collector:4318 (spans go to {endpoint}/v1/traces)."""
    trace_prompts: bool = False
    """Put the prompt (messages or text) in the gateway's request span. Off by default: prompts are
    tenants' data. API keys are never recorded."""
    trace_sample_ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of new traces recorded (a trace started upstream keeps its caller's decision)."""
    trace_buffer_spans: int = Field(4096, ge=16)
    """Finished spans kept in memory for the dashboard's waterfalls."""

    @property
    def tracing_enabled(self) -> bool:
        return self.tracing or bool(self.otlp_endpoint)


SpanDict = dict[str, Any]


def _value(value: Any) -> Any:
    if isinstance(value, str | bool | int | float):
        return value
    return [v for v in value] if isinstance(value, tuple | list) else str(value)


def span_to_dict(span: ReadableSpan) -> SpanDict:
    context, parent = span.get_span_context(), span.parent
    assert context is not None
    return {
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        # a process-local root: no parent, or a parent in another process
        "local_root": parent is None or parent.is_remote,
        "name": span.name,
        "kind": span.kind.name if isinstance(span.kind, SpanKind) else str(span.kind),
        "service": str(span.resource.attributes.get("service.name", "")),
        "start_ns": span.start_time or 0,
        "end_ns": span.end_time or 0,
        "status": span.status.status_code.name,
        "attributes": {key: _value(value) for key, value in (span.attributes or {}).items()},
    }


class RecentSpans(SpanProcessor):
    def __init__(self, capacity: int = 4096) -> None:
        self._spans: deque[ReadableSpan] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            self._spans.append(span)

    def spans(self) -> list[SpanDict]:
        with self._lock:
            spans = list(self._spans)
        return [span_to_dict(span) for span in spans]

    def for_traces(self, trace_ids: Iterable[str]) -> list[SpanDict]:
        wanted = set(trace_ids)
        return [s for s in self.spans() if s["trace_id"] in wanted]

    def recent_roots(self, limit: int, kind: str = "SERVER") -> list[SpanDict]:
        """The newest process-local root spans of `kind` (one per trace), newest first."""
        roots: list[SpanDict] = []
        seen: set[str] = set()
        for span in reversed(self.spans()):
            if span["local_root"] and span["kind"] == kind and span["trace_id"] not in seen:
                seen.add(span["trace_id"])
                roots.append(span)
                if len(roots) == limit:
                    break
        return roots


PROPAGATOR = TraceContextTextMapPropagator()
"""W3C `traceparent` / `tracestate`, on every internal HTTP call and batch line."""


def traces_url(endpoint: str) -> str:
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def build_tracer_provider(service_name: str, settings: TracingSettings) -> tuple[TracerProvider, RecentSpans]:
    resource = Resource.create({"service.name": service_name, "service.namespace": "tollway",
                                "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio)))
    recent = RecentSpans(settings.trace_buffer_spans)
    provider.add_span_processor(recent)
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(settings.otlp_endpoint))))
    return provider, recent
