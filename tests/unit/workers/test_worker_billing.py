"""The real worker keeps every billed request's usage, as its engine counted it, until a gateway
acknowledges the row: requests that ran to the end, were cancelled, or were abandoned by a closed
channel alike; unbilled requests (no `billing` in the body) leave nothing behind."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from workers.server.billing import BILLING_KEY

pytestmark = pytest.mark.asyncio
PROMPT = list(range(5, 45))
BILLING = {"tenant_id": 1, "key_id": None, "model": "tiny", "batch_id": None,
           "started_at": "2026-11-23T00:00:00+00:00"}


def body(request_id: str, billed: bool = True, **sampling) -> dict:
    sampling = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, **sampling}
    out = {"request_id": request_id, "namespace": "t", "prompt_token_ids": PROMPT, "sampling": sampling}
    return {**out, "billing": BILLING} if billed else out


async def until(predicate, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_usage_is_kept_until_acknowledged_and_orphaned_when_the_channel_closes(worker) -> None:
    client, _ = worker
    ledger = client.app[BILLING_KEY].ledger
    async with client.ws_connect("/internal/channel") as ws:
        await ws.send_bytes(orjson.dumps({"op": "generate", "id": 1, "body": body("done")}))
        await ws.send_bytes(orjson.dumps({"op": "generate", "id": 2, "body": body("free", billed=False)}))
        await ws.send_bytes(orjson.dumps({"op": "generate", "id": 3, "body": body("long", max_tokens=10_000)}))
        finished = set()
        while finished != {1, 2}:
            frame = orjson.loads((await asyncio.wait_for(ws.receive(), 30)).data)
            if any("usage" in line for line in frame["lines"]):
                finished.add(frame["id"])
        await until(lambda: ledger.num_open == 1)
        assert ledger.orphans() == []  # owned by this open channel: its gateway acknowledges
        await ws.send_bytes(orjson.dumps({"op": "ack", "request_ids": ["done"]}))
        await until(lambda: ledger.num_open == 0)
    # The channel closed with "long" still running: the engine aborts it and its usage is an orphan.
    await until(lambda: ledger.num_orphans == 1)
    [orphan] = ledger.orphans()
    assert orphan.request_id == "long" and orphan.billing == BILLING and orphan.finish_reason == "abort"
    assert orphan.usage["prompt_tokens"] == len(PROMPT) and 0 < orphan.usage["completion_tokens"] < 10_000

    info = await (await client.get("/internal/info")).json()
    assert info["usage_ledger"] == {"unacknowledged": 1, "orphans": 1}
    fetched = await (await client.get("/internal/usage/orphans")).json()
    assert [o["request_id"] for o in fetched["orphans"]] == ["long"]
    acked = await client.post("/internal/usage/ack", json={"request_ids": ["long"]})
    assert (await acked.json()) == {"acknowledged": 1} and ledger.num_open == 0
    assert (await client.post("/internal/usage/ack", json={"ids": 1})).status == 400


async def test_a_cancelled_request_keeps_its_abort_usage(worker) -> None:
    client, _ = worker
    ledger = client.app[BILLING_KEY].ledger
    async with client.ws_connect("/internal/channel") as ws:
        await ws.send_bytes(orjson.dumps({"op": "generate", "id": 7, "body": body("stopped", max_tokens=10_000)}))
        await asyncio.wait_for(ws.receive(), 30)
        await ws.send_bytes(orjson.dumps({"op": "cancel", "id": 7}))
        lines = []
        while not any("usage" in line for line in lines):
            lines += orjson.loads((await asyncio.wait_for(ws.receive(), 30)).data)["lines"]
        await until(lambda: ledger.num_open == 1)
        entry = ledger.get("stopped")
        assert entry is not None and entry.usage == lines[-1]["usage"] and entry.finish_reason == "abort"
