"""Speculative decoding's figures on the worker's /metrics and /internal/info, on each request's
`worker.generate` span (drafted / accepted tokens over its choices), and the settings' startup check
(issue 23)."""

from __future__ import annotations

import click
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from ops.offline import engine_config
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel
from workers.server.app import create_worker_app
from workers.settings import WorkerSettings
from workers.tracing import WorkerTracing


@pytest.mark.asyncio
async def test_worker_metrics_report_drafted_and_accepted_tokens(aiohttp_client, tiny: LoadedModel) -> None:
    engine = AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64, block_size=8, speculative="ngram",
                                                                speculative_timed=False), name="tiny"))
    try:
        client = await aiohttp_client(create_worker_app(engine, secret="s"), headers={"Authorization": "Bearer s"})
        body = {"request_id": "r1", "namespace": "t", "prompt_token_ids": list(range(5, 15)) * 4,
                "sampling": {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}}
        await (await client.post("/internal/generate", json=body)).read()
        text = await (await client.get("/metrics")).text()
        info = await (await client.get("/internal/info")).json()
    finally:
        engine.shutdown()
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    spec = info["speculative"]
    assert spec["mode"] == "ngram" and spec["drafted_tokens"] > 0
    assert values["tollway_worker_speculative_drafted_tokens_total"] == spec["drafted_tokens"]
    assert values["tollway_worker_speculative_accepted_tokens_total"] == spec["accepted_tokens"]
    assert 0 <= values["tollway_worker_speculative_acceptance_rate"] <= 1
    assert values["tollway_worker_speculative_acceptance_rate"] == pytest.approx(
        spec["accepted_tokens"] / spec["drafted_tokens"])
    assert values["tollway_worker_speculative_mean_accepted_length"] == pytest.approx(
        spec["accepted_tokens"] / spec["verifications"])


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["ngram", "off"])
async def test_the_request_span_carries_drafted_and_accepted_tokens(aiohttp_client, tiny: LoadedModel,
                                                                    mode: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("worker")
    config = EngineConfig(num_blocks=64, block_size=8, speculative=mode, speculative_timed=False)  # type: ignore[arg-type]
    engine = AsyncEngine(Engine(tiny, config, name="tiny", tracer=tracer))
    try:
        client = await aiohttp_client(create_worker_app(engine, WorkerTracing(tracer), secret="s"),
                                      headers={"Authorization": "Bearer s"})
        body = {"request_id": "r1", "namespace": "t", "prompt_token_ids": list(range(5, 15)) * 4,
                "sampling": {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "n": 2}}
        await (await client.post("/internal/generate", json=body)).read()
    finally:
        engine.shutdown()
    [span] = [s for s in exporter.get_finished_spans() if s.name == "worker.generate"]
    stats = engine.engine.spec_stats  # this request's two choices were all the engine ran
    if mode == "off":
        assert "tollway.speculative.drafted_tokens" not in span.attributes
        return
    assert stats.drafted_tokens > 0
    assert span.attributes["tollway.speculative.drafted_tokens"] == stats.drafted_tokens
    assert span.attributes["tollway.speculative.accepted_tokens"] == stats.accepted_tokens
    assert span.attributes["gen_ai.usage.output_tokens"] == 48


def test_settings_pass_speculation_and_refuse_a_draft_mode_without_a_draft_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLWAY_SPECULATIVE", "ngram")
    monkeypatch.setenv("TOLLWAY_SPECULATIVE_TOKENS", "6")
    monkeypatch.setenv("TOLLWAY_SPECULATIVE_MAX_BATCH", "1")
    config = engine_config(WorkerSettings())
    assert config.speculative == "ngram" and config.speculative_tokens == 6 and config.speculative_ngram == 3
    assert config.speculative_max_batch == 1
    monkeypatch.setenv("TOLLWAY_SPECULATIVE", "draft")
    monkeypatch.delenv("TOLLWAY_DRAFT_MODEL", raising=False)
    with pytest.raises(click.ClickException, match="needs TOLLWAY_DRAFT_MODEL"):
        engine_config(WorkerSettings())
    monkeypatch.setenv("TOLLWAY_SPECULATIVE", "ngram")
    monkeypatch.setenv("TOLLWAY_SPECULATIVE_TOKENS", "0")
    with pytest.raises(click.ClickException, match="at least 1"):
        engine_config(WorkerSettings())
