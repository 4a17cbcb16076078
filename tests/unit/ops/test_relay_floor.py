"""The gateway bench's relay floor (ops/bench/relay_floor.py): the bench's chat request answered over the worker
channel, with the worker's tokens and usage, each request a generate request of its own on the worker, acknowledged
once answered as the gateway acknowledges a billed one."""

from __future__ import annotations

import asyncio

import pytest

from ops.bench.relay_floor import PROMPT_IDS, create_relay_app
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from workers.server.billing import BILLING_KEY

pytestmark = pytest.mark.asyncio


async def test_the_relay_answers_with_the_workers_tokens(aiohttp_server, aiohttp_client) -> None:
    worker = FakeWorker(record_bodies=True)
    server = await aiohttp_server(create_fake_worker_app(worker))
    client = await aiohttp_client(create_relay_app(str(server.make_url("")).rstrip("/"), FAKE_WORKER_SECRET))
    answers = []
    for max_tokens in (3, 5):
        response = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens})
        assert response.status == 200
        answers.append(await response.json())
    assert [a["usage"]["completion_tokens"] for a in answers] == [3, 5]
    assert all(a["usage"]["prompt_tokens"] == len(PROMPT_IDS) for a in answers)
    assert answers[0]["choices"][0]["message"]["content"] and answers[0]["id"] != answers[1]["id"]
    assert [body["prompt_token_ids"] for body in worker.requests] == [PROMPT_IDS, PROMPT_IDS]
    assert (await client.get("/healthz")).status == 200
    ledger = server.app[BILLING_KEY].ledger  # each usage kept until acknowledged, as the gateway does
    for _ in range(100):
        if ledger.num_open == 0:
            break
        await asyncio.sleep(0.01)
    assert ledger.num_open == 0 and len(worker.requests) == 2
