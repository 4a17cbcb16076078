"""Per-tenant scheduling figures (issue 25): the worker's /metrics and /internal/info, and the
dashboard's table of them."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.dashboard_render import DashboardData, panel
from gateway.observability.live_stats import LiveStats
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel
from workers.server.app import create_worker_app


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.asyncio
async def test_worker_metrics_show_each_tenants_service_weight_and_queues(aiohttp_client, tiny: LoadedModel) -> None:
    engine = AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64, block_size=8, scheduling="fcfs"), name="tiny"))
    try:
        client = await aiohttp_client(create_worker_app(engine, secret="s"), headers={"Authorization": "Bearer s"})
        body = {"request_id": "r1", "namespace": "tenant-7", "prompt_token_ids": list(range(5, 25)),
                "sampling": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}, "weight": 2}
        await (await client.post("/internal/generate", json=body)).read()
        await (await client.post("/internal/generate", json={**body, "request_id": "r2", "namespace": "tenant-8",
                                                             "weight": 1})).read()
        values = samples(await (await client.get("/metrics")).text())
        info = await (await client.get("/internal/info")).json()
    finally:
        engine.shutdown()
    seven, eight = (("tenant", "tenant-7"),), (("tenant", "tenant-8"),)
    assert info["scheduling"] == "fcfs"
    assert values[("tollway_worker_tenant_weight", seven)] == 2 and values[("tollway_worker_tenant_weight", eight)] == 1
    assert values[("tollway_worker_tenant_service_tokens_total", (("kind", "input"), *seven))] == 20
    assert values[("tollway_worker_tenant_service_tokens_total", (("kind", "output"), *seven))] == 4
    # input x1 + output x2, divided by the weight: 7 was served (20 + 8) / 2; 8 arrived when nobody
    # waited, so it starts from the counter of the last tenant to leave the queue (7's 20/2 then)
    assert values[("tollway_worker_tenant_virtual_tokens", seven)] == (20 + 4 * 2) / 2
    assert values[("tollway_worker_tenant_virtual_tokens", eight)] == 20 / 2 + 20 + 4 * 2
    assert values[("tollway_worker_tenant_waiting_requests", seven)] == 0
    assert values[("tollway_worker_tenant_running_requests", eight)] == 0
    assert info["tenants"]["tenant-7"]["output_tokens"] == 4


def test_dashboard_lists_each_workers_tenants_furthest_behind_first() -> None:
    stats = LiveStats()
    worker = {"url": "http://w1", "healthy": True, "model": "tiny", "in_flight": 3, "info": {
        "scheduling": "fair", "blocks": {"total": 8, "free": 8, "used": 0, "evictable": 0}, "tenants": {
            "tenant-2": {"counter": 900.0, "weight": 1.0, "input_tokens": 300, "output_tokens": 300,
                         "waiting": 5, "running": 2},
            "tenant-1": {"counter": 450.0, "weight": 2.0, "input_tokens": 600, "output_tokens": 150,
                         "waiting": 1, "running": 1}}}}
    html = panel(DashboardData(stats.window(60), stats.window(300), stats.requests_series(10), [worker],
                               "2026-11", []))
    table = html[html.index('<table id="scheduling">'):]
    assert table.index("tenant-1") < table.index("tenant-2")
    assert "<td>fair</td><td>2.00</td><td>450</td><td>1</td><td>1</td><td>600</td><td>150</td>" in table
    empty = panel(DashboardData(stats.window(60), stats.window(300), stats.requests_series(10), [], "2026-11", []))
    assert 'id="scheduling-empty"' in empty
