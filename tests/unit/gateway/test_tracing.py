"""One trace per request across the gateway, the worker and the engine (SDK in-memory exporter).

A real gateway (the app factory) in front of a real worker server on a tiny random-weight model,
both tracing into one in-memory exporter: a streamed chat request must make one trace whose spans
form the documented tree, with GenAI attributes, the worker's spans joined through `traceparent`,
and neither the API key nor (by default) the prompt in any attribute.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import ClientSession
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.app import create_app
from gateway.observability.tracing import GatewayTracing
from gateway.settings import GatewaySettings
from gateway.state import POOL
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from tests.unit.gateway.test_gateway_api import make_tenant_key
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel
from workers.server.app import create_worker_app
from workers.tracing import WorkerTracing
from workers.wire.telemetry import RecentSpans

pytestmark = pytest.mark.asyncio
PROMPT_TEXT = "w5 w6 w7 w8 w9 w10 w11 w12"


class Traced:
    """A gateway's and a worker's tracing as in two processes (each its own service name and ring
    buffer), exporting into one in-memory exporter."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.gateway_recent, self.worker_recent = RecentSpans(1024), RecentSpans(1024)
        self.gateway = self._provider("tollway-gateway", self.gateway_recent)
        self.worker = self._provider("tollway-worker", self.worker_recent)

    def _provider(self, service: str, recent: RecentSpans) -> TracerProvider:
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        provider.add_span_processor(recent)
        return provider

    def spans(self) -> list:
        return list(self.exporter.get_finished_spans())


async def start(aiohttp_client, aiohttp_server, tmp_path: Path, tiny: LoadedModel, traced: Traced | None,
                record_prompts: bool = False):
    worker_tracing = WorkerTracing(traced.worker.get_tracer("worker"), traced.worker_recent) if traced else None
    engine = AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64, block_size=8), name="tiny",
                                tracer=worker_tracing.tracer if worker_tracing else None))
    worker = await aiohttp_server(create_worker_app(engine, worker_tracing, secret=FAKE_WORKER_SECRET))
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db", "acme")
    settings = GatewaySettings(home=tmp_path, worker_urls=str(worker.make_url("")).rstrip("/"),
                               admin_key="test-admin-key", worker_secret=FAKE_WORKER_SECRET, health_interval_s=0.2)
    tracing = GatewayTracing(traced.gateway.get_tracer("gateway"), traced.gateway_recent, record_prompts) \
        if traced else None
    client = await aiohttp_client(create_app(settings, tracing=tracing))
    return client, key, engine


@pytest_asyncio.fixture
async def traced_stack(aiohttp_client, aiohttp_server, tmp_path: Path, tiny: LoadedModel):
    traced = Traced()
    client, key, engine = await start(aiohttp_client, aiohttp_server, tmp_path, tiny, traced)
    yield client, key, traced
    engine.shutdown()


async def streamed_chat(client, key: str, **extra) -> str:
    response = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT_TEXT}], "max_tokens": 6,
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True,
        **extra})
    assert response.status == 200, await response.text()
    text = await response.text()
    assert text.endswith("data: [DONE]\n\n")
    return text


def by_name(spans: list) -> dict[str, list]:
    named: dict[str, list] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def parent_of(span) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_one_streamed_chat_request_is_one_trace_across_gateway_worker_and_engine(traced_stack) -> None:
    client, key, traced = traced_stack
    await streamed_chat(client, key)
    spans = traced.spans()
    assert len({s.context.trace_id for s in spans}) == 1, [s.name for s in spans]
    named = by_name(spans)

    [root] = named["chat tiny"]
    assert root.kind is SpanKind.SERVER and root.parent is None
    attributes = root.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.usage.output_tokens"] == 6
    assert attributes["gen_ai.usage.input_tokens"] == attributes["tollway.request.prompt_tokens"] > 8
    assert attributes["tollway.cache.cached_tokens"] == 0
    assert list(attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert attributes["tollway.tenant.name"] == "acme" and isinstance(attributes["tollway.tenant.id"], int)
    assert attributes["http.response.status_code"] == 200 and attributes["http.route"] == "/v1/chat/completions"

    gateway_children = {"gateway.auth", "gateway.tokenize", "gateway.quota.admit", "gateway.route",
                        "gateway.worker.generate", "gateway.metering.commit", "gateway.quota.settle"}
    for name in gateway_children:
        [span] = named[name]
        assert parent_of(span) == root.context.span_id, name
    # in request order
    starts = {name: named[name][0].start_time for name in gateway_children}
    assert sorted(gateway_children, key=starts.get) == [
        "gateway.auth", "gateway.tokenize", "gateway.quota.admit", "gateway.route", "gateway.worker.generate",
        "gateway.metering.commit", "gateway.quota.settle"]
    [call] = named["gateway.worker.generate"]
    assert call.kind is SpanKind.CLIENT

    # the worker joined the gateway's trace through traceparent
    [served] = named["worker.generate"]
    assert served.kind is SpanKind.SERVER and parent_of(served) == call.context.span_id and served.parent.is_remote
    assert served.attributes["gen_ai.usage.output_tokens"] == 6
    assert served.attributes["tollway.request.id"] == attributes["tollway.request.id"]
    engine_spans = [s for s in spans if s.name.startswith("engine.")]
    assert {s.name for s in engine_spans} == {"engine.queue_wait", "engine.prefill", "engine.decode"}
    assert all(parent_of(s) == served.context.span_id for s in engine_spans)
    [prefill] = named["engine.prefill"]
    assert prefill.attributes["tollway.prefill.new_tokens"] == attributes["gen_ai.usage.input_tokens"]
    assert prefill.attributes["tollway.prefill.cached_tokens"] == 0
    assert named["engine.decode"][0].attributes["tollway.decode.steps"] == 5

    # time nests: engine inside worker inside the gateway's call inside the request
    for inner, outer in ((served, call), (call, root), (prefill, served)):
        assert outer.start_time <= inner.start_time and inner.end_time <= outer.end_time

    # no key, no prompt text anywhere
    values = [str(v) for s in spans for v in (s.attributes or {}).values()]
    assert not any(key in v or "test-admin-key" in v for v in values)
    assert not any("w7 w8" in v for v in values)


async def test_a_repeated_prompt_reports_cached_tokens_at_each_level(traced_stack) -> None:
    client, key, traced = traced_stack
    await streamed_chat(client, key)
    traced.exporter.clear()
    await streamed_chat(client, key)
    named = by_name(traced.spans())
    [root], [prefill] = named["chat tiny"], named["engine.prefill"]
    cached = root.attributes["tollway.cache.cached_tokens"]
    assert cached > 0 and prefill.attributes["tollway.prefill.cached_tokens"] == cached
    assert named["worker.generate"][0].attributes["tollway.cache.cached_tokens"] == cached


async def test_prompts_are_recorded_only_when_opted_in(aiohttp_client, aiohttp_server, tmp_path, tiny) -> None:
    traced = Traced()
    client, key, engine = await start(aiohttp_client, aiohttp_server, tmp_path, tiny, traced, record_prompts=True)
    try:
        await streamed_chat(client, key)
    finally:
        engine.shutdown()
    [root] = by_name(traced.spans())["chat tiny"]
    assert PROMPT_TEXT in root.attributes["gen_ai.input.messages"]


async def test_errors_and_a_callers_traceparent(traced_stack) -> None:
    client, _key, traced = traced_stack
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    response = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer tw-wrong",
                                                                  "traceparent": caller}, json={"model": "tiny"})
    assert response.status == 401
    named = by_name(traced.spans())
    [root] = named["POST /v1/chat/completions"]
    assert f"{root.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert root.attributes["http.response.status_code"] == 401
    assert root.status.is_unset  # a 4xx is the caller's, not a failure of ours
    [auth] = named["gateway.auth"]
    assert not auth.status.is_ok and not auth.status.is_unset
    assert not any("tw-wrong" in str(v) for s in traced.spans() for v in (s.attributes or {}).values())


async def test_the_recent_spans_buffers_and_the_workers_traces_route(traced_stack) -> None:
    client, key, traced = traced_stack
    await streamed_chat(client, key)
    [root] = traced.gateway_recent.recent_roots(5)
    assert root["name"] == "chat tiny" and root["attributes"]["gen_ai.usage.output_tokens"] == 6
    assert root["service"] == "tollway-gateway" and root["local_root"]
    mine = traced.gateway_recent.for_traces([root["trace_id"]])
    assert {s["name"] for s in mine} == {s.name for s in traced.spans() if s.name.startswith(("chat", "gateway."))}
    [worker_url] = client.app[POOL].workers
    async with ClientSession(headers={"Authorization": f"Bearer {FAKE_WORKER_SECRET}"}) as http:
        async with http.get(f"{worker_url}/internal/traces", params={"trace_id": root["trace_id"]}) as response:
            theirs = (await response.json())["spans"]
        async with http.get(f"{worker_url}/internal/traces", params=[("trace_id", "0")] * 65) as response:
            assert response.status == 400
    assert {s["name"] for s in theirs} == {"worker.generate", "engine.queue_wait", "engine.prefill", "engine.decode"}
    assert len(mine) + len(theirs) == len(traced.spans())
    [served] = [s for s in theirs if s["name"] == "worker.generate"]
    assert served["local_root"] and served["kind"] == "SERVER" and served["service"] == "tollway-worker"


async def test_tracing_off_sends_no_traceparent(aiohttp_client, aiohttp_server, tmp_path: Path) -> None:
    fake = FakeWorker()
    worker = await aiohttp_server(create_fake_worker_app(fake))
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db")
    app = create_app(GatewaySettings(home=tmp_path, worker_urls=str(worker.make_url("")).rstrip("/"),
                                     admin_key="test-admin-key", worker_secret=FAKE_WORKER_SECRET,
                                     health_interval_s=0.2))
    client = await aiohttp_client(app)
    response = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "smollm2-135m-instruct", "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "hi"}],
                                       "stream": True})
    assert response.status == 200
    await response.read()
    assert len(fake.requests) == 1 and fake.trace_headers == [{}]
