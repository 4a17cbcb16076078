"""Prometheus metrics of the gateway and the worker, read back through their /metrics text."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.observability.live_stats import LiveStats
from gateway.settings import GatewaySettings
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from tests.unit.gateway.test_gateway_api import ADMIN, MODEL, chat, make_tenant_key
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.server.app import create_worker_app


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.asyncio
async def test_gateway_metrics_count_requests_tokens_and_rejections(aiohttp_client, aiohttp_server,
                                                                   tmp_path: Path) -> None:
    worker = FakeWorker(context_length=256, cached_tokens=lambda ns, prompt: 8)
    server = await aiohttp_server(create_fake_worker_app(worker))
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db", "acme", rpm=2)
    client = await aiohttp_client(create_app(GatewaySettings(
        home=tmp_path, worker_urls=str(server.make_url("")).rstrip("/"), admin_key="test-admin-key",
        worker_secret=FAKE_WORKER_SECRET, health_interval_s=0.2)))
    auth = {"Authorization": f"Bearer {key}"}
    assert (await client.post("/v1/chat/completions", headers=auth, json=chat())).status == 200
    streamed = await client.post("/v1/chat/completions", headers=auth, json=chat(stream=True, max_tokens=5))
    assert streamed.status == 200
    await streamed.read()
    assert (await client.post("/v1/chat/completions", headers=auth, json=chat(model="nope"))).status == 404
    assert (await client.post("/v1/chat/completions", headers=auth, json=chat())).status == 429  # rpm 2 (the 404 was never admitted)
    assert (await client.post("/v1/chat/completions", json=chat())).status == 401

    assert (await client.get("/metrics")).status == 401  # tenant names and traffic: admin only
    assert (await client.get("/metrics", headers={"Authorization": f"Bearer {key}"})).status == 401
    response = await client.get("/metrics", headers=ADMIN)
    assert response.status == 200 and response.content_type == "text/plain"
    values = samples(await response.text())

    def value(name: str, **labels: str) -> float:
        return values.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("tollway_requests_total", tenant="acme", model=MODEL, status="200") == 2
    assert value("tollway_requests_total", tenant="acme", model="-", status="404") == 1  # unknown model: "-"
    assert value("tollway_requests_total", tenant="acme", model=MODEL, status="429") == 1
    assert value("tollway_requests_total", tenant="-", model="-", status="401") == 1
    assert value("tollway_quota_rejections_total", tenant="acme", reason="rpm") == 1
    assert value("tollway_completion_tokens_total", tenant="acme", model=MODEL) == 3 + 5
    prompt = sum(len(body["prompt_token_ids"]) for body in worker.requests)
    assert value("tollway_prompt_tokens_total", tenant="acme", model=MODEL) == prompt
    assert value("tollway_cached_prompt_tokens_total", tenant="acme", model=MODEL) == 16
    assert value("tollway_time_to_first_token_seconds_count", model=MODEL) == 2
    assert value("tollway_inter_token_latency_seconds_count", model=MODEL) == 2
    assert value("tollway_request_duration_seconds_count", model=MODEL) == 3  # the 200s and the 429
    assert value("tollway_requests_in_flight", model=MODEL) == 0
    assert value("tollway_worker_up", worker=str(server.make_url("")).rstrip("/")) == 1
    assert ("tollway_batches", (("status", "validating"),)) not in values  # no batches yet: no series


@pytest.mark.asyncio
async def test_worker_metrics_expose_engine_state(aiohttp_client, tiny) -> None:
    engine = AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64, block_size=8), name="tiny"))
    try:
        client = await aiohttp_client(create_worker_app(engine, secret="s"), headers={"Authorization": "Bearer s"})
        body = {"request_id": "r1", "namespace": "t", "prompt_token_ids": list(range(5, 45)),
                "sampling": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}}
        for request_id in ("r1", "r2"):
            await (await client.post("/internal/generate", json={**body, "request_id": request_id})).read()
        values = samples(await (await client.get("/metrics")).text())
        cache = engine.info()["cache"]["t"]
    finally:
        engine.shutdown()
    assert values[("tollway_worker_kv_blocks", (("state", "total"),))] == 64
    assert values[("tollway_worker_kv_blocks", (("state", "free"),))] + \
        values[("tollway_worker_kv_blocks", (("state", "evictable"),))] == 64
    # the prefix tree's own counts (whole blocks): the second request hit the first one's blocks
    assert values[("tollway_worker_prefix_cache_hit_tokens_total", ())] == cache["hit_tokens"] == 32
    assert values[("tollway_worker_prefix_cache_miss_tokens_total", ())] == cache["miss_tokens"] > 0
    assert values[("tollway_worker_completion_tokens_total", ())] == 8
    assert values[("tollway_worker_preemptions_total", ())] == 0
    assert values[("tollway_worker_running_requests", ())] == 0


def test_live_stats_windows_and_series() -> None:
    now = [1000.0]
    stats = LiveStats(clock=lambda: now[0])
    for second in range(10):
        now[0] = 1000.0 + second
        stats.add_request(error=second == 9)
        stats.add_usage(100, 40, 10, ttft_s=0.01 * (second + 1))
    window = stats.window(60)
    assert (window.requests, window.errors, window.completion_tokens) == (10, 1, 100)
    assert window.cache_hit_ratio == pytest.approx(0.4) and window.ttft_p50_s == pytest.approx(0.06)
    assert stats.window(5).requests == 5
    assert stats.requests_series(12) == [0, 0] + [1] * 10
    now[0] += 400  # beyond the horizon: everything aged out
    assert stats.window(300).requests == 0
