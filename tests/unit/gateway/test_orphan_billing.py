"""Exact billing when the gateway that carried a request dies: the worker keeps the usage of every
billed request until a gateway acknowledges its committed row; a request whose channel closed
first is an orphan, which the next gateway (or any replica) bills as `gateway_lost`, exactly once.
Here against the fake worker, whose ledger is the real worker's (workers/server/ledger.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson
import pytest

from gateway.state import POOL
from gateway.upstream import channel as channel_module
from gateway.upstream.channel import WorkerChannel
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from tests.unit.gateway.test_gateway_api import MODEL, chat, make_tenant_key, start_gateway
from tests.unit.gateway.test_gateway_metering import usage_rows
from workers.server.billing import BILLING_KEY

pytestmark = pytest.mark.asyncio


def billed_body(request_id: str, tenant_id: int) -> dict:
    return {"request_id": request_id, "namespace": f"tenant-{tenant_id}", "prompt_token_ids": [5, 6, 7],
            "sampling": {"max_tokens": 50}, "billing": {"tenant_id": tenant_id, "key_id": None, "model": MODEL,
                                                        "batch_id": None,
                                                        "started_at": "2026-11-23T01:00:00+00:00"}}


async def test_a_dead_gateways_streams_are_billed_by_the_next_one(aiohttp_client, aiohttp_server,
                                                                  tmp_path: Path) -> None:
    worker_app = create_fake_worker_app(FakeWorker(delay_s=0.01))
    worker_url = str((await aiohttp_server(worker_app)).make_url("")).rstrip("/")
    tenant_id, _ = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db")
    ledger = worker_app[BILLING_KEY].ledger

    # A "gateway" that sends two billed requests on its channel, reads a few tokens, and dies.
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {FAKE_WORKER_SECRET}"}) as session:
        ws = await session.ws_connect(f"{worker_url}/internal/channel")
        for channel_id, request_id in enumerate(("chatcmpl-lost-1", "chatcmpl-lost-2")):
            await ws.send_bytes(orjson.dumps({"op": "generate", "id": channel_id,
                                              "body": billed_body(request_id, tenant_id)}))
        received = 0
        while received < 6:
            frame = orjson.loads((await asyncio.wait_for(ws.receive(), 10)).data)
            received += len(frame["lines"])
        await ws.close()
    for _ in range(100):
        if ledger.num_orphans == 2:
            break
        await asyncio.sleep(0.02)
    orphans = {e.request_id: e for e in ledger.orphans()}
    assert set(orphans) == {"chatcmpl-lost-1", "chatcmpl-lost-2"}
    assert all(3 <= e.usage["completion_tokens"] < 50 for e in orphans.values())  # ≥ the client's, < the ask

    # The next gateway bills them before it serves, then acknowledges them.
    client = await start_gateway(aiohttp_client, tmp_path, [worker_url])
    rows = {row.request_id: row for row in usage_rows(tmp_path)}
    assert set(rows) == set(orphans)
    for request_id, row in rows.items():
        assert (row.status, row.tenant_id, row.model) == ("gateway_lost", tenant_id, MODEL)
        assert row.completion_tokens == orphans[request_id].usage["completion_tokens"]
        assert row.prompt_tokens == 3
    assert ledger.num_open == 0

    # A second replica billing the same orphan (the first died between commit and ack) adds no row.
    ledger.record(orphans["chatcmpl-lost-1"], None)
    await client.app[POOL].poll_all()
    assert len(usage_rows(tmp_path)) == 2 and ledger.num_open == 0


async def test_served_requests_are_acknowledged_and_leave_no_orphans(aiohttp_client, aiohttp_server,
                                                                     tmp_path: Path) -> None:
    worker_app = create_fake_worker_app(FakeWorker())
    worker_url = str((await aiohttp_server(worker_app)).make_url("")).rstrip("/")
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db")
    client = await start_gateway(aiohttp_client, tmp_path, [worker_url])
    auth = {"Authorization": f"Bearer {key}"}
    for body in (chat(), chat(stream=True)):
        assert (await client.post("/v1/chat/completions", headers=auth, json=body)).status == 200
    ledger = worker_app[BILLING_KEY].ledger
    for _ in range(100):  # acks travel in one frame per loop turn
        if ledger.num_open == 0:
            break
        await asyncio.sleep(0.01)
    assert ledger.num_open == 0 and len(usage_rows(tmp_path)) == 2
    await client.close()  # the gateway's channel closes: nothing is left to become an orphan
    assert ledger.num_orphans == 0


async def test_acks_ride_with_the_next_request_or_leave_after_a_delay(aiohttp_server, monkeypatch) -> None:
    worker_app = create_fake_worker_app(FakeWorker())
    worker_url = str((await aiohttp_server(worker_app)).make_url("")).rstrip("/")
    ledger = worker_app[BILLING_KEY].ledger
    monkeypatch.setattr(channel_module, "ACK_DELAY_S", 30.0)  # only a generate frame (or close) sends them

    async def served(channel: WorkerChannel, request_id: str) -> None:
        assert [line async for line in channel.generate(billed_body(request_id, 1), {})][-1]["usage"]

    async with aiohttp.ClientSession() as session:
        channel = WorkerChannel(worker_url, session, 2.0, {"Authorization": f"Bearer {FAKE_WORKER_SECRET}"})
        await served(channel, "chatcmpl-a")
        channel.acknowledge("chatcmpl-a")
        await asyncio.sleep(0.1)
        assert ledger.get("chatcmpl-a") is not None  # held back: no frame of its own
        await served(channel, "chatcmpl-b")  # its generate frame carries the ack
        assert ledger.get("chatcmpl-a") is None and ledger.get("chatcmpl-b") is not None
        channel.acknowledge("chatcmpl-b")
        await channel.close()  # sends what is held back before closing
        assert ledger.num_open == 0 and ledger.num_orphans == 0

        monkeypatch.setattr(channel_module, "ACK_DELAY_S", 0.05)
        channel = WorkerChannel(worker_url, session, 2.0, {"Authorization": f"Bearer {FAKE_WORKER_SECRET}"})
        await served(channel, "chatcmpl-c")
        channel.acknowledge("chatcmpl-c")
        for _ in range(100):  # no other frame comes: the delay sends it
            if ledger.num_open == 0:
                break
            await asyncio.sleep(0.01)
        assert ledger.num_open == 0
        await channel.close()
