"""Batched channel messages (workers/wire/channel.py BATCH_PROTOCOL, workers/wire/outbox.py): a caller
that offers the subprotocol may send several frames in one message and gets the frames of one loop
turn in one message; the gateway's end negotiates it."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import WSMsgType

from gateway.upstream.channel import WorkerChannel
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from workers.wire.channel import (
    BATCH_PROTOCOL,
    BadFrame,
    CancelFrame,
    GenerateFrame,
    LinesFrame,
    decode_answers,
    decode_requests,
    encode_message,
)

AUTH = {"Authorization": f"Bearer {FAKE_WORKER_SECRET}"}


def body(request_id: str, max_tokens: int = 4) -> dict:
    return {"request_id": request_id, "namespace": "t", "prompt_token_ids": [5, 6, 7],
            "sampling": {"max_tokens": max_tokens}}


def test_a_message_holds_one_frame_as_itself_and_several_as_an_array() -> None:
    one = GenerateFrame(1, body("a")).encode()
    assert encode_message([one]) == one
    frames = decode_requests(encode_message([one, CancelFrame(1).encode(), b'{"op": "nope", "id": 2}']))
    assert isinstance(frames[0], GenerateFrame) and frames[1] == CancelFrame(1) and isinstance(frames[2], BadFrame)
    assert isinstance(decode_requests(b"not json")[0], BadFrame)
    lines = [LinesFrame(1, [{"index": 0}]).encode(), LinesFrame(2, [{"index": 0}]).encode()]
    assert [f.id for f in decode_answers(encode_message(lines))] == [1, 2]


@pytest.mark.asyncio
async def test_a_caller_offering_batches_gets_a_turn_of_frames_in_one_message(aiohttp_client) -> None:
    client = await aiohttp_client(create_fake_worker_app(FakeWorker()))
    async with client.ws_connect("/internal/channel", headers=AUTH, protocols=(BATCH_PROTOCOL,)) as ws:
        assert ws.protocol == BATCH_PROTOCOL
        await ws.send_bytes(encode_message([GenerateFrame(i, body(f"r{i}")).encode() for i in range(3)]))
        lines: dict[int, list[dict]] = {0: [], 1: [], 2: []}
        messages, arrays = 0, 0
        while not all(ls and "usage" in ls[-1] for ls in lines.values()):
            message = await asyncio.wait_for(ws.receive(), 10)
            assert message.type == WSMsgType.BINARY
            messages += 1
            arrays += isinstance(orjson.loads(message.data), list)
            for frame in decode_answers(message.data):
                assert isinstance(frame, LinesFrame)
                lines[frame.id].extend(frame.lines)
    assert all(len(ls) == 4 for ls in lines.values())
    assert messages < 12 and arrays >= 1  # 12 frames (3 requests x 4 lines) in fewer messages


@pytest.mark.asyncio
async def test_the_gateway_end_negotiates_batches(aiohttp_server) -> None:
    server = await aiohttp_server(create_fake_worker_app(FakeWorker()))
    async with aiohttp.ClientSession() as session:
        channel = WorkerChannel(str(server.make_url("")).rstrip("/"), session, 2.0, AUTH)

        async def collect(request_id: str) -> list[dict]:
            return [line async for line in channel.generate(body(request_id, 6), {})]

        answers = await asyncio.gather(*(collect(f"g{i}") for i in range(8)))
        assert all(len(lines) == 6 and "usage" in lines[-1] for lines in answers)
        assert channel._connection is not None and channel._connection.ws.protocol == BATCH_PROTOCOL
        await channel.close()
