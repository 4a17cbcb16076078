"""Metering, quotas and Idempotency-Key through the real gateway app, against a fake worker:
one usage row per request with the worker's exact usage, clients that hang up billed for what was
generated, 429s with OpenAI's types and headers, and retries that are never billed twice."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import pytest_asyncio
from sqlalchemy import select

from accounting.db import create_db_engine, session_factory
from accounting.models import UsageEvent
from gateway.state import POOL, WRITER
from ops.fake_worker import FakeWorker, create_fake_worker_app
from tests.unit.gateway.test_gateway_api import MODEL, chat, make_tenant_key, sse_events, start_gateway

pytestmark = pytest.mark.asyncio


def usage_rows(tmp_path: Path) -> list[UsageEvent]:
    engine = create_db_engine(f"sqlite:///{tmp_path}/tollway.db")
    with session_factory(engine)() as session:
        rows = list(session.scalars(select(UsageEvent).order_by(UsageEvent.id)))
    engine.dispose()
    return rows


async def gateway_for(aiohttp_client, aiohttp_server, tmp_path: Path, worker: FakeWorker, **quotas: int):
    url = str((await aiohttp_server(create_fake_worker_app(worker))).make_url("")).rstrip("/")
    tenant_id, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db", **quotas)
    client = await start_gateway(aiohttp_client, tmp_path, [url])
    return client, {"Authorization": f"Bearer {key}"}, tenant_id


@pytest_asyncio.fixture
async def setup(aiohttp_client, aiohttp_server, tmp_path: Path):
    worker = FakeWorker(cached_tokens=lambda namespace, prompt: 4)
    client, auth, tenant_id = await gateway_for(aiohttp_client, aiohttp_server, tmp_path, worker)
    return client, auth, worker, tenant_id, tmp_path


async def test_every_request_gets_exactly_one_row_with_the_workers_usage(setup) -> None:
    client, auth, _, tenant_id, tmp_path = setup
    plain = await (await client.post("/v1/chat/completions", headers=auth, json=chat())).json()
    streamed = sse_events(await (await client.post(
        "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": True,
                                               "stream_options": {"include_usage": True}})).text())
    usage = json.loads(streamed[-2])["usage"]
    rows = {row.request_id: row for row in usage_rows(tmp_path)}
    assert set(rows) == {plain["id"], json.loads(streamed[0])["id"]}
    first = rows[plain["id"]]
    assert (first.tenant_id, first.model, first.status, first.finish_reason) == (tenant_id, MODEL, "ok", "length")
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (
        plain["usage"]["prompt_tokens"], 4, 3)
    second = rows[json.loads(streamed[0])["id"]]
    assert (second.prompt_tokens, second.cached_tokens, second.completion_tokens) == (3, 4, 5) == (
        usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"])
    assert first.ttft_ms is not None and first.latency_ms >= first.ttft_ms


async def test_a_client_that_hangs_up_is_billed_for_what_was_generated(aiohttp_client, aiohttp_server,
                                                                       tmp_path: Path) -> None:
    worker = FakeWorker(delay_s=0.02)
    client, auth, _ = await gateway_for(aiohttp_client, aiohttp_server, tmp_path, worker)
    response = await client.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=500, stream=True))
    for _ in range(4):
        await response.content.readline()
    response.close()  # the client goes away mid-stream
    for _ in range(100):
        rows = usage_rows(tmp_path)
        if rows:
            break
        await asyncio.sleep(0.05)
    [row] = rows
    assert row.status == "client_disconnected" and row.finish_reason == "abort"
    assert 1 <= row.completion_tokens < 500  # the worker stopped, and told us how far it got
    assert not worker.running


async def test_a_joined_answer_still_records_the_time_to_its_first_token(aiohttp_client, aiohttp_server,
                                                                           tmp_path: Path) -> None:
    worker = FakeWorker(delay_s=0.05)  # 5 tokens: the first ~50 ms in, the last ~250 ms
    client, auth, _ = await gateway_for(aiohttp_client, aiohttp_server, tmp_path, worker)
    response = await client.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=5))
    assert response.status == 200 and worker.requests[-1]["stream"] is False
    [row] = usage_rows(tmp_path)
    assert row.latency_ms >= 250 and row.ttft_ms < row.latency_ms - 150  # decode_s took the decode off


async def test_quota_rejections_are_429s_with_openai_types_and_headers(aiohttp_client, aiohttp_server,
                                                                       tmp_path: Path) -> None:
    client, auth, _ = await gateway_for(aiohttp_client, aiohttp_server, tmp_path, FakeWorker(), rpm=2, tpm=10_000)
    ok = await client.post("/v1/chat/completions", headers=auth, json=chat())
    assert ok.status == 200
    assert ok.headers["x-ratelimit-limit-requests"] == "2" and ok.headers["x-ratelimit-remaining-requests"] == "1"
    assert ok.headers["x-ratelimit-limit-tokens"] == "10000"
    assert {"x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"} <= set(ok.headers)
    assert (await client.post("/v1/chat/completions", headers=auth, json=chat())).status == 200
    refused = await client.post("/v1/chat/completions", headers=auth, json=chat())
    assert refused.status == 429
    assert (await refused.json())["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["Retry-After"]) >= 1 and refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert len(usage_rows(tmp_path)) == 2  # refused requests are not billed


async def test_a_spent_budget_is_insufficient_quota_and_retrying_cannot_help(aiohttp_client, aiohttp_server,
                                                                             tmp_path: Path) -> None:
    client, auth, _ = await gateway_for(aiohttp_client, aiohttp_server, tmp_path, FakeWorker(),
                                        monthly_token_budget=60)
    assert (await client.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=10))).status == 200
    refused = await client.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=40))
    assert refused.status == 429 and refused.headers["x-should-retry"] == "false"
    assert (await refused.json())["error"]["type"] == "insufficient_quota"


async def test_a_request_larger_than_the_tpm_limit_is_told_it_can_never_fit(aiohttp_client, aiohttp_server,
                                                                            tmp_path: Path) -> None:
    client, auth, _ = await gateway_for(aiohttp_client, aiohttp_server, tmp_path, FakeWorker(), tpm=100)
    refused = await client.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=500))
    assert refused.status == 429 and refused.headers["x-should-retry"] == "false"
    message = (await refused.json())["error"]["message"]
    assert "tokens-per-minute limit of 100" in message and "lower max_tokens" in message
    assert (await client.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=10))).status == 200


async def test_an_idempotent_retry_gets_the_stored_response_and_is_not_billed_twice(setup) -> None:
    client, auth, worker, _, tmp_path = setup
    headers = {**auth, "Idempotency-Key": "order-42"}
    first = await client.post("/v1/chat/completions", headers=headers, json=chat())
    again = await client.post("/v1/chat/completions", headers=headers, json=chat())
    assert again.status == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert await again.read() == await first.read()
    assert len(worker.requests) == 1 and len(usage_rows(tmp_path)) == 1
    changed = await client.post("/v1/chat/completions", headers=headers, json=chat(max_tokens=4))
    assert changed.status == 422

    stream_headers = {**auth, "Idempotency-Key": "stream-7"}
    body = chat(stream=True, stream_options={"include_usage": True})
    streamed = await (await client.post("/v1/chat/completions", headers=stream_headers, json=body)).read()
    replayed = await client.post("/v1/chat/completions", headers=stream_headers, json=body)
    assert await replayed.read() == streamed and replayed.headers["Content-Type"].startswith("text/event-stream")
    assert len(usage_rows(tmp_path)) == 2


async def test_a_key_is_released_when_the_request_fails_unbilled(aiohttp_client, aiohttp_server, tmp_path) -> None:
    worker = FakeWorker(fail_after_tokens=0)  # dies before streaming anything, every time
    client, auth, _ = await gateway_for(aiohttp_client, aiohttp_server, tmp_path, worker)
    headers = {**auth, "Idempotency-Key": "k1"}
    assert (await client.post("/v1/chat/completions", headers=headers, json=chat())).status == 503
    worker.fail_after_tokens = None
    await client.app[POOL].poll_all()  # back in rotation
    retried = await client.post("/v1/chat/completions", headers=headers, json=chat())
    assert retried.status == 200 and "Idempotent-Replayed" not in retried.headers
    assert len(usage_rows(tmp_path)) == 1


async def test_a_client_gone_before_the_first_token_stops_the_worker_and_is_billed(
        aiohttp_client, aiohttp_server, tmp_path: Path) -> None:
    worker = FakeWorker(delay_s=0.2)  # the first token takes a while
    client, auth, _ = await gateway_for(aiohttp_client, aiohttp_server, tmp_path, worker)
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.1):
            await client.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=50))
    for _ in range(100):
        rows = usage_rows(tmp_path)
        if rows:
            break
        await asyncio.sleep(0.05)
    [row] = rows
    assert row.status == "client_disconnected" and row.completion_tokens < 50
    assert not worker.running


async def test_a_request_alone_commits_its_row_inline_and_concurrent_ones_on_the_writer(
        aiohttp_client, aiohttp_server, tmp_path) -> None:
    """With one request in flight the gateway commits its usage row on the event loop's thread (no handoff to
    the writer thread and back); while others are in flight, the writer thread's group commit takes it."""
    worker = FakeWorker(delay_s=0.05)  # three lines of 50 ms: concurrent requests overlap
    client, auth, _ = await gateway_for(aiohttp_client, aiohttp_server, tmp_path, worker)
    writer = client.server.app[WRITER]
    committed_on: list[str] = []
    insert = writer._insert

    def recording(records):
        insert(records)
        committed_on.extend(threading.current_thread().name for _ in records)

    writer._insert = recording
    assert (await client.post("/v1/chat/completions", headers=auth, json=chat())).status == 200
    assert committed_on == [threading.current_thread().name]
    committed_on.clear()
    answers = await asyncio.gather(*(client.post("/v1/chat/completions", headers=auth, json=chat()) for _ in range(3)))
    assert [a.status for a in answers] == [200] * 3
    assert len(committed_on) == 3 and "usage-writer" in committed_on  # the first to finish had company
    assert len(usage_rows(tmp_path)) == 4
