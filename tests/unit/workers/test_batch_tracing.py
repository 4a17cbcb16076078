"""Batch jobs in traces: the run task links to the batch's creating request, each line is a span
whose traceparent the gateway continues (runner against a real gateway app and a fake worker)."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.app import create_app
from gateway.batches.dispatch import BATCH_DISPATCHER, CeleryDispatcher
from gateway.observability.tracing import GatewayTracing
from gateway.settings import GatewaySettings
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from tests.unit.gateway.test_batches_api import ADMIN, RecordingDispatcher
from tests.unit.gateway.test_gateway_api import MODEL, make_tenant_key
from tests.unit.workers.test_batch_runner import Env
from workers.jobs.tasks import batch_links

pytestmark = pytest.mark.asyncio


class CapturingCelery:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send_task(self, name: str, **options) -> None:
        self.sent.append({"name": name, **options})


async def test_batch_lines_are_spans_the_gateway_continues(aiohttp_client, aiohttp_server, tmp_path: Path) -> None:
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    server = await aiohttp_server(create_fake_worker_app(FakeWorker(context_length=256)))
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db", "acme")
    app = create_app(GatewaySettings(home=tmp_path, worker_secret=FAKE_WORKER_SECRET, worker_urls=str(server.make_url("")).rstrip("/"),
                                     admin_key=ADMIN, health_interval_s=0.2),
                     tracing=GatewayTracing(tracer))
    app[BATCH_DISPATCHER] = RecordingDispatcher()
    env = Env(await aiohttp_client(app), FakeWorker(), tmp_path, key)
    try:
        batch_id = await env.create(3)
        step = env.step(batch_id)
        step.tracer = tracer
        with tracer.start_as_current_span("tollway.batches.run", kind=SpanKind.CONSUMER) as run:
            assert await step.run() == "ended"
    finally:
        env.engine.dispose()
    spans = exporter.get_finished_spans()
    lines = [s for s in spans if s.name == "batch.line"]
    assert sorted(s.attributes["tollway.batch.line"] for s in lines) == [1, 2, 3]
    assert all(s.parent.span_id == run.get_span_context().span_id for s in lines)
    assert sorted(s.attributes["http.response.status_code"] for s in lines) == [200, 200, 404]
    requests = [s for s in spans if s.kind is SpanKind.SERVER and s.attributes.get("tollway.batch.id") == batch_id]
    assert len(requests) == 3  # one per line, each a child of its line's span (across HTTP)
    assert {s.parent.span_id for s in requests} == {s.context.span_id for s in lines}
    assert all(s.parent.is_remote and s.context.trace_id == run.get_span_context().trace_id for s in requests)
    assert sum(s.name == f"chat {MODEL}" for s in requests) == 2


async def test_the_run_task_links_to_the_request_that_created_the_batch() -> None:
    provider = TracerProvider()
    dispatcher = CeleryDispatcher("memory://")
    dispatcher._app = celery = CapturingCelery()
    dispatcher.dispatch("batch_untraced")
    with provider.get_tracer("test").start_as_current_span("POST /v1/batches") as created:
        dispatcher.dispatch("batch_traced")
    untraced, traced = celery.sent
    assert untraced["kwargs"] is None and untraced["args"] == ["batch_untraced"]
    [link] = batch_links(traced["kwargs"]["link"])
    assert link.context.trace_id == created.get_span_context().trace_id
    assert link.context.span_id == created.get_span_context().span_id
    assert batch_links(None) == [] and batch_links("not-a-traceparent") == []
