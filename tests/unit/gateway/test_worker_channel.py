"""The generate channel (workers/server/channel.py, gateway/upstream/channel.py): many requests on one
websocket, on a real aiohttp server and a tiny random-weight model; and the gateway's end of it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import orjson
import pytest
from aiohttp import WSMsgType

from gateway.upstream.channel import ChannelClosed, ChannelRefused, WorkerChannel
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app

PROMPT = list(range(5, 45))
pytestmark = pytest.mark.asyncio


def body(request_id: str, **sampling) -> dict:
    sampling = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, **sampling}
    return {"request_id": request_id, "namespace": "t", "prompt_token_ids": PROMPT, "sampling": sampling}


async def frames_until_done(ws, ids: set) -> dict:
    """Every frame by request id until each of `ids` ended (usage or error)."""
    seen: dict = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        message = await asyncio.wait_for(ws.receive(), 30)
        assert message.type == WSMsgType.BINARY
        frame = orjson.loads(message.data)
        seen[frame["id"]].append(frame)
        if "error" in frame or any("usage" in line for line in frame["lines"]):
            open_ids.discard(frame["id"])
    return seen


async def test_requests_share_one_channel_and_match_the_http_answer(worker) -> None:
    client, _ = worker
    http = [json.loads(line) for line in (await (await client.post(
        "/internal/generate", json=body("h"))).text()).splitlines()]
    async with client.ws_connect("/internal/channel") as ws:
        await ws.send_bytes(orjson.dumps({"op": "generate", "id": 1, "body": body("a"), "headers": {}}))
        await ws.send_bytes(orjson.dumps({"op": "generate", "id": 2, "body": {**body("b"), "stream": False}}))
        await ws.send_bytes(orjson.dumps({"op": "generate", "id": 3, "body": {**body("c"), "priority": "urgent"}}))
        seen = await frames_until_done(ws, {1, 2, 3})
    streamed = [line for frame in seen[1] for line in frame["lines"]]

    def without_cache(lines: list[dict]) -> list[dict]:  # the repeat's prompt is cached: all else is equal
        return [{**line, "usage": {**line["usage"], "cached_tokens": 0}} if "usage" in line else line
                for line in lines]

    assert without_cache(streamed) == without_cache(http)  # the NDJSON answer's lines (greedy, same prompt)
    assert streamed[-1]["usage"]["cached_tokens"] == len(PROMPT) - 1
    [joined] = [line for frame in seen[2] for line in frame["lines"]]
    assert joined["token_ids"] == [t for line in http for t in line["token_ids"]] and joined["usage"]
    assert seen[3] == [{"id": 3, "error": {"status": 400, "message": "priority must be 'interactive' or 'batch'"}}]


async def test_cancel_and_a_closed_channel_stop_their_requests(worker) -> None:
    client, engine = worker
    async with client.ws_connect("/internal/channel") as ws:
        await ws.send_bytes(orjson.dumps({"op": "generate", "id": 7, "body": body("long", max_tokens=10_000)}))
        first = orjson.loads((await asyncio.wait_for(ws.receive(), 30)).data)
        assert first["id"] == 7 and first["lines"][0]["finish_reason"] is None
        await ws.send_bytes(orjson.dumps({"op": "cancel", "id": 7}))  # the cancel verb
        await ws.send_bytes(orjson.dumps({"op": "generate", "id": 8, "body": body("long2", max_tokens=10_000)}))
        for _ in range(200):
            if engine.info()["finished"].get("abort") == 1 and engine.info()["running"] == 1:
                break
            await asyncio.sleep(0.05)
        assert engine.info()["finished"] == {"abort": 1}  # 7 stopped, 8 still running
    for _ in range(200):  # the channel closed: 8 is aborted too
        if engine.info()["running"] == 0:
            break
        await asyncio.sleep(0.05)
    info = engine.info()
    assert info["running"] == 0 and info["finished"] == {"abort": 2}
    assert info["blocks"]["free"] + info["blocks"]["evictable"] == info["blocks"]["total"]


async def test_a_bad_frame_is_answered_and_the_channel_goes_on(worker) -> None:
    client, _ = worker
    async with client.ws_connect("/internal/channel") as ws:
        await ws.send_bytes(b"not json")
        assert orjson.loads((await ws.receive()).data) == {"id": None, "error": {"status": 400,
                                                                                 "message": "bad channel frame"}}
        await ws.send_bytes(orjson.dumps({"op": "generate", "id": 1, "body": body("ok")}))
        seen = await frames_until_done(ws, {1})
    assert "usage" in seen[1][-1]["lines"][-1]


async def test_the_gateway_end_multiplexes_reconnects_and_reports_failures(aiohttp_server) -> None:
    fake = FakeWorker()
    server = await aiohttp_server(create_fake_worker_app(fake))
    async with aiohttp.ClientSession() as session:
        url = str(server.make_url("")).rstrip("/")
        await gateway_end_checks(fake, WorkerChannel(url, session, 2.0,
                                                     {"Authorization": f"Bearer {FAKE_WORKER_SECRET}"}))
        # Another secret: the upgrade is refused, and the request fails as a closed channel (retryable).
        fake.secret = "rotated"
        stale = WorkerChannel(url, session, 2.0, {"Authorization": f"Bearer {FAKE_WORKER_SECRET}"})
        with pytest.raises(ChannelClosed, match="401"):
            [line async for line in stale.generate(body("refused"), {})]
        await stale.close()


async def gateway_end_checks(fake: FakeWorker, channel: WorkerChannel) -> None:

    async def collect(request_id: str, **extra) -> list[dict]:
        return [line async for line in channel.generate({**body(request_id), **extra}, {})]

    answers = await asyncio.gather(*(collect(f"r{i}") for i in range(5)))
    assert all(len(lines) == 6 and "usage" in lines[-1] for lines in answers)
    first_connection = channel._connection
    with pytest.raises(ChannelRefused) as refused:
        await collect("bad", prompt_token_ids=[])
    assert refused.value.status == 400 and "no tokens" in refused.value.message
    fake.fail_after_tokens = 2  # the worker "dies" mid-answer: the connection ends for every request on it
    with pytest.raises(ChannelClosed):
        await collect("dies")
    fake.fail_after_tokens = None
    assert len(await collect("after")) == 6  # a new connection, opened on demand
    assert channel._connection is not first_connection
    await channel.close()
