"""`/readyz` across a cold start: 503 `not_ready` while no engine worker is in rotation (the worker
starts after the gateway here), 200 once one is; `/healthz` is liveness, 200 throughout. A worker
holding another secret never enters the rotation, and the gateway says why."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from aiohttp import web

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.state import POOL
from gateway.upstream.pool import WRONG_SECRET
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from tests.net import free_port

pytestmark = pytest.mark.asyncio


async def gateway(aiohttp_client, tmp_path: Path, worker_url: str):
    return await aiohttp_client(create_app(GatewaySettings(
        home=tmp_path, worker_urls=worker_url, admin_key="k", worker_secret=FAKE_WORKER_SECRET,
        health_interval_s=0.05)))


async def serve_worker(worker: FakeWorker, port: int) -> web.AppRunner:
    runner = web.AppRunner(create_fake_worker_app(worker))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_readyz_is_503_until_a_worker_is_in_rotation_then_200(aiohttp_client, tmp_path: Path) -> None:
    port = free_port()
    client = await gateway(aiohttp_client, tmp_path, f"http://127.0.0.1:{port}")  # nothing listens there yet
    response = await client.get("/readyz")
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    assert await response.json() == {"status": "not_ready", "reason": "no engine worker is in rotation yet",
                                      "workers_healthy": 0, "workers_total": 1}
    assert (await client.get("/healthz")).status == 200  # alive, just not ready

    runner = await serve_worker(FakeWorker(), port)  # the worker comes up after the gateway
    try:
        async with asyncio.timeout(10):
            while (response := await client.get("/readyz")).status != 200:
                assert response.status == 503
                await asyncio.sleep(0.05)
        assert await response.json() == {"status": "ready", "workers_healthy": 1, "workers_total": 1}
    finally:
        await runner.cleanup()
    async with asyncio.timeout(10):  # and back to 503 when the only worker is gone
        while (await client.get("/readyz")).status != 503:
            await asyncio.sleep(0.05)


async def test_a_worker_with_another_secret_stays_out_and_the_gateway_says_why(
        aiohttp_client, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    worker = FakeWorker(secret="a-different-secret")
    runner = await serve_worker(worker, port)
    try:
        with caplog.at_level(logging.WARNING, "tollway.gateway"):
            client = await gateway(aiohttp_client, tmp_path, f"http://127.0.0.1:{port}")
            await asyncio.sleep(0.3)  # several polls
            assert (await client.get("/readyz")).status == 503
        [state] = client.app[POOL].workers.values()
        assert not state.healthy and state.last_error == WRONG_SECRET
        assert caplog.text.count("TOLLWAY_WORKER_SECRET") == 1  # said once, not on every poll
        assert worker.received == 0
        worker.secret = FAKE_WORKER_SECRET  # fixed: the worker joins the rotation by itself
        async with asyncio.timeout(10):
            while (await client.get("/readyz")).status != 200:
                await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
