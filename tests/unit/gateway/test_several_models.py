"""One gateway in front of workers of several models (what `tollway up --model A --model B` runs),
against fake workers: every request goes to a worker of its own model only, `/v1/models` lists each
model once, usage rows carry the model, an unknown model is a 404 naming the served ones, a model
whose workers are all down is a 503 (never another model's worker), and `/readyz?model=` waits for
each model named."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio

from gateway.state import POOL
from ops.fake_worker import FakeWorker, create_fake_worker_app
from ops.supervisor import readiness
from tests.unit.gateway.test_gateway_api import make_tenant_key, start_gateway
from tests.unit.gateway.test_gateway_metering import usage_rows

pytestmark = pytest.mark.asyncio


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest_asyncio.fixture
async def fleet(aiohttp_client, aiohttp_server, tmp_path: Path):
    """(client, auth, {name: fake worker}, {name: url}): two workers of model "alpha", one of "beta"."""
    workers = {"alpha-0": FakeWorker(model="alpha"), "alpha-1": FakeWorker(model="alpha"),
               "beta-0": FakeWorker(model="beta", context_length=512)}
    urls = {name: str((await aiohttp_server(create_fake_worker_app(w))).make_url("")).rstrip("/")
            for name, w in workers.items()}
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db")
    client = await start_gateway(aiohttp_client, tmp_path, list(urls.values()))
    return client, {"Authorization": f"Bearer {key}"}, workers, urls


async def test_each_request_reaches_only_workers_of_its_model(fleet, tmp_path: Path) -> None:
    client, auth, workers, _ = fleet
    ids = {}
    for model in ("alpha", "beta", "alpha", "beta", "alpha"):
        response = await client.post("/v1/chat/completions", headers=auth, json=chat(model))
        assert response.status == 200, await response.text()
        body = await response.json()
        assert body["model"] == model
        ids[body["id"]] = model
    assert workers["alpha-0"].received + workers["alpha-1"].received == 3
    assert workers["beta-0"].received == 2
    rows = {row.request_id: row.model for row in usage_rows(tmp_path)}
    assert rows == ids  # one row per request, each carrying the model that served it


async def test_models_lists_each_served_model_once_and_an_unknown_one_is_a_404(fleet) -> None:
    client, auth, _, _ = fleet
    listed = await (await client.get("/v1/models", headers=auth)).json()
    assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]
    assert (await (await client.get("/v1/models/beta", headers=auth)).json())["id"] == "beta"
    response = await client.post("/v1/chat/completions", headers=auth, json=chat("gamma"))
    assert response.status == 404
    error = (await response.json())["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "available: alpha, beta" in error["message"]


async def test_a_model_with_no_worker_left_is_a_503_not_another_models_worker(fleet) -> None:
    client, auth, workers, urls = fleet
    pool = client.app[POOL]
    workers["beta-0"].secret = "rotated"  # its polls now fail (401): out of rotation
    async with asyncio.timeout(10):
        while pool.workers[urls["beta-0"]].healthy:
            await asyncio.sleep(0.02)
    alpha_before = workers["alpha-0"].received + workers["alpha-1"].received
    response = await client.post("/v1/chat/completions", headers=auth, json=chat("beta"))
    assert response.status == 503 and (await response.json())["error"]["code"] == "no_worker"
    assert workers["alpha-0"].received + workers["alpha-1"].received == alpha_before
    assert (await client.post("/v1/chat/completions", headers=auth, json=chat("alpha"))).status == 200


async def test_readyz_with_models_waits_for_a_worker_of_each(fleet) -> None:
    client, _, workers, urls = fleet
    ready = await client.get("/readyz", params=[("model", "alpha"), ("model", "beta")])
    assert ready.status == 200 and (await ready.json())["status"] == "ready"
    workers["beta-0"].secret = "rotated"
    async with asyncio.timeout(10):
        while client.app[POOL].workers[urls["beta-0"]].healthy:
            await asyncio.sleep(0.02)
    assert (await client.get("/readyz")).status == 200  # alpha still serves: ready for anything
    response = await client.get("/readyz", params=[("model", "alpha"), ("model", "beta")])
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    body = await response.json()
    assert body["models_missing"] == ["beta"] and body["workers_healthy"] == 2
    # what `tollway up` prints while it waits
    state = await asyncio.to_thread(readiness, str(client.make_url("/readyz?model=alpha&model=beta")))
    assert state == (False, "2 of 3 engine workers in rotation; no worker of beta yet")


async def test_readyz_refuses_an_empty_model_name(fleet) -> None:
    client = fleet[0]
    for params in ([("model", "")], [("model", "alpha"), ("model", "  ")]):
        response = await client.get("/readyz", params=params)
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "model"
