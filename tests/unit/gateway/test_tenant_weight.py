"""A tenant's scheduling weight (issue 25) from the CLI and the admin API, through the database and
the gateway, onto the wire and into the worker's fair scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.app import create_app
from gateway.settings import GatewaySettings
from ops.cli import cli
from ops.fake_worker import FAKE_WORKER_SECRET
from tests.unit.gateway.test_gateway_api import ADMIN
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel
from workers.server.app import create_worker_app
from workers.wire.generate import BadRequest, generate_body, parse_generate

pytestmark = pytest.mark.asyncio


def run_cli(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


async def test_weight_travels_from_the_cli_to_the_workers_scheduler(aiohttp_client, aiohttp_server, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   tiny: LoadedModel) -> None:
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path))
    monkeypatch.delenv("TOLLWAY_DATABASE_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    assert "weight 2" in run_cli("tenants", "create", "heavy", "--weight", "2")
    assert "weight 3.5" in run_cli("tenants", "update", "heavy", "--weight", "3.5")
    assert " 3.5 " in run_cli("tenants", "list")
    key = run_cli("keys", "create", "--tenant", "heavy").strip()
    engine = AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64, block_size=8), name="tiny"))
    try:
        worker = await aiohttp_server(create_worker_app(engine, secret=FAKE_WORKER_SECRET))
        client = await aiohttp_client(create_app(GatewaySettings(
            home=tmp_path, worker_urls=str(worker.make_url("")).rstrip("/"), admin_key="test-admin-key",
            worker_secret=FAKE_WORKER_SECRET, health_interval_s=0.2)))
        tenant = await (await client.get("/admin/v1/tenants/heavy", headers=ADMIN)).json()
        assert tenant["weight"] == 3.5
        response = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
            "model": "tiny", "messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 3})
        assert response.status == 200, await response.text()
        tenants = engine.engine.scheduler.tenant_stats()  # the engine thread is idle again: safe to read
    finally:
        engine.shutdown()
    assert tenants[f"tenant-{tenant['id']}"]["weight"] == 3.5
    assert tenants[f"tenant-{tenant['id']}"]["output_tokens"] > 0


async def test_admin_api_sets_the_weight_and_refuses_a_bad_one(aiohttp_client, tmp_path: Path) -> None:
    client = await aiohttp_client(create_app(GatewaySettings(home=tmp_path, worker_urls="", admin_key="test-admin-key",
                                                             worker_secret=FAKE_WORKER_SECRET)))
    created = await client.post("/admin/v1/tenants", headers=ADMIN, json={"name": "plain"})
    assert created.status == 201 and (await created.json())["weight"] == 1.0
    created = await client.post("/admin/v1/tenants", headers=ADMIN, json={"name": "double", "weight": 2})
    assert created.status == 201 and (await created.json())["weight"] == 2.0
    for bad in (0, -1, "2", True, None, 1e9):
        for response in (await client.post("/admin/v1/tenants", headers=ADMIN, json={"name": "x", "weight": bad}),
                         await client.patch("/admin/v1/tenants/plain", headers=ADMIN, json={"weight": bad})):
            assert response.status == 400, bad
            error = (await response.json())["error"]
            assert error["param"] == "weight" and "weight" in error["message"]
    assert (await client.get("/admin/v1/tenants/x", headers=ADMIN)).status == 404
    updated = await client.patch("/admin/v1/tenants/plain", headers=ADMIN, json={"weight": 0.5})
    assert updated.status == 200 and (await updated.json())["weight"] == 0.5


async def test_the_wire_carries_the_weight_and_refuses_a_bad_one() -> None:
    body = generate_body("r1", "tenant-1", [5, 6], {}, weight=2.0)
    assert parse_generate(body).weight == 2.0
    del body["weight"]
    assert parse_generate(body).weight == 1.0  # callers that send none (tests, benches) get 1
    for bad in (0, -0.5, float("nan"), float("inf"), "2", True):
        with pytest.raises(BadRequest, match="weight"):
            parse_generate({**body, "weight": bad})
