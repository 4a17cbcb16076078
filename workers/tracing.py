"""The engine side's tracing: a worker's (or batch runner's) tracer and its recent spans.

Off unless TOLLWAY_TRACING or TOLLWAY_OTLP_ENDPOINT is set; then the worker continues the
gateway's trace from the `traceparent` of each generate call (workers/server/app.py), and the engine
thread hangs its phase spans under it (workers/engine/phase_spans.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from workers.wire.telemetry import RecentSpans, TracingSettings, build_tracer_provider


@dataclass
class WorkerTracing:
    tracer: Tracer
    recent: RecentSpans | None = None  # served at GET /internal/traces for the gateway's dashboard
    provider: TracerProvider | None = None  # shut down (flushed) by its owner

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def worker_tracing(settings: TracingSettings, service_name: str = "tollway-worker") -> WorkerTracing | None:
    if not settings.tracing_enabled:
        return None
    provider, recent = build_tracer_provider(service_name, settings)
    return WorkerTracing(provider.get_tracer("tollway.worker"), recent, provider)
