"""Quotas exact across gateway replicas sharing one Redis, concurrency limits seen at the worker,
and metering that survives a gateway SIGKILL (real processes, real Redis and PostgreSQL; the
worker is the `ops.fake_worker` test double: these tests are about the gateway)."""

from __future__ import annotations

import asyncio
import random
import uuid
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import orjson
import pytest
from sqlalchemy import create_engine, text

from tests.integration.gateway_cluster import Cluster, prepare_tenant

pytestmark = [pytest.mark.services, pytest.mark.asyncio]
MODEL = "smollm2-135m-instruct"


@pytest.fixture
def cluster_env(redis_url: str, postgres_schema: tuple[str, str]) -> dict[str, str]:
    return {"TOLLWAY_REDIS_URL": redis_url, "TOLLWAY_QUOTA_PREFIX": f"test-{uuid.uuid4().hex[:8]}"}


def chat(max_tokens: int = 4, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **fields}


async def test_four_replicas_on_one_redis_admit_exactly_rpm(tmp_path: Path, postgres_schema, cluster_env) -> None:
    database_url, _ = postgres_schema
    key = prepare_tenant(database_url, rpm=100)
    cluster = Cluster.start(tmp_path, database_url, **cluster_env)
    try:
        urls = [cluster.start_gateway() for _ in range(4)]
        headers = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(i: int) -> int:
                async with session.post(f"{urls[i % 4]}/v1/chat/completions", json=chat(), headers=headers) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(*(one(i) for i in range(400)))
        assert statuses.count(200) == 100 and statuses.count(429) == 300
        assert cluster.worker_info()["fake"]["requests"] == 100
    finally:
        cluster.stop()


async def test_max_concurrent_holds_at_the_worker(tmp_path: Path, postgres_schema, cluster_env) -> None:
    database_url, _ = postgres_schema
    key = prepare_tenant(database_url, max_concurrent=8)
    cluster = Cluster.start(tmp_path, database_url, delay_s=0.01, **cluster_env)
    try:
        urls = [cluster.start_gateway() for _ in range(4)]
        headers = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def client(i: int) -> int:
                done = 0
                for _ in range(6):  # each of 32 clients keeps asking; refused ones retry shortly
                    async with session.post(f"{urls[i % 4]}/v1/chat/completions", json=chat(max_tokens=10),
                                            headers=headers) as r:
                        await r.read()
                        done += r.status == 200
                        if r.status == 429:
                            await asyncio.sleep(0.05)
                return done

            served = sum(await asyncio.gather(*(client(i) for i in range(32))))
        peak = cluster.worker_info()["fake"]["max_running"]
        assert 0 < peak <= 8 and served > 8
    finally:
        cluster.stop()


async def stream_one(session: aiohttp.ClientSession, url: str, headers: dict[str, str], outcome: dict,
                     max_tokens: int) -> None:
    """Read one streamed chat completion, recording its id, tokens seen and whether it ended."""
    body = chat(max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    try:
        async with session.post(f"{url}/v1/chat/completions", headers=headers, json=body) as r:
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line.removeprefix(b"data: ")
                if data == b"[DONE]":
                    outcome["done"] = True
                    return
                chunk = orjson.loads(data)
                outcome["id"] = chunk.get("id", outcome.get("id"))
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        outcome["tokens"] = outcome.get("tokens", 0) + choice["delta"]["content"].count("tok")
    except (TimeoutError, aiohttp.ClientError):
        pass  # the gateway died under it


async def test_metering_survives_a_gateway_sigkill(tmp_path: Path, postgres_schema, cluster_env) -> None:
    database_url, _ = postgres_schema
    key = prepare_tenant(database_url)
    cluster = Cluster.start(tmp_path, database_url, delay_s=0.03, **cluster_env)
    try:
        url = cluster.start_gateway()
        port = int(url.rsplit(":", 1)[1])
        headers = {"Authorization": f"Bearer {key}"}
        outcomes: list[dict] = [{} for _ in range(200)]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=60)) as session:
            # Streams of 5 to 80 tokens (0.15 to 2.4 s): they end over a spread of time, and the kill
            # lands once a random number of them (20 to 120) have ended.
            clients = asyncio.gather(*(stream_one(session, url, headers, o, random.randint(5, 80))
                                       for o in outcomes))
            target = random.randint(20, 120)
            while sum("done" in o for o in outcomes) < target and not clients.done():
                await asyncio.sleep(0.005)
            cluster.kill_gateway(port)
            await clients
        cluster.start_gateway(port)  # restarted on the same port: it replays its own spool, if any
        finished = {o["id"]: o["tokens"] for o in outcomes if o.get("done")}
        engine = create_engine(database_url)
        with engine.connect() as connection:
            rows = connection.execute(text(
                "SELECT request_id, completion_tokens FROM usage_events")).all()
        engine.dispose()
        billed = dict(rows)
        print(f"{len(finished)} of 200 streams finished before the kill; {len(billed)} usage rows")
        assert 0 < len(finished) < 200  # the kill landed mid-run
        assert len(billed) == len(rows)  # no duplicates
        for request_id, tokens in finished.items():
            assert billed.get(request_id) == tokens, request_id
    finally:
        cluster.stop()


def usage_by_request(database_url: str) -> dict[str, list[tuple[str, int]]]:
    engine = create_engine(database_url)
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT request_id, status, completion_tokens FROM usage_events")).all()
    engine.dispose()
    found: dict[str, list[tuple[str, int]]] = {}
    for request_id, status, completion in rows:
        found.setdefault(request_id, []).append((status, completion))
    return found


async def test_streams_in_flight_at_a_gateway_sigkill_are_billed_exactly_once(
        tmp_path: Path, postgres_schema, cluster_env) -> None:
    """16 streams have each received tokens when their gateway is SIGKILLed: the worker keeps what
    it generated for them, and the restarted gateway bills every one (`gateway_lost`), at least what
    its client received, exactly once; the month's report matches the rows."""
    from accounting.db import session_factory
    from accounting.reports import usage_report

    database_url, _ = postgres_schema
    key = prepare_tenant(database_url)
    cluster = Cluster.start(tmp_path, database_url, delay_s=0.05, **cluster_env)
    try:
        url = cluster.start_gateway()
        port = int(url.rsplit(":", 1)[1])
        headers = {"Authorization": f"Bearer {key}"}
        outcomes: list[dict] = [{} for _ in range(16)]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=60)) as session:
            clients = asyncio.gather(*(stream_one(session, url, headers, o, 200) for o in outcomes))
            while not all(o.get("tokens") for o in outcomes) and not clients.done():
                await asyncio.sleep(0.01)
            cluster.kill_gateway(port)
            await clients
        assert not any(o.get("done") for o in outcomes)  # every stream was cut mid-way
        cluster.start_gateway(port)  # bills its predecessor's orphans before it serves
        rows = usage_by_request(database_url)
        for outcome in outcomes:
            [(status, completion)] = rows[outcome["id"]]
            assert status == "gateway_lost" and completion >= outcome["tokens"], (outcome, status, completion)
        assert cluster.worker_info()["usage_ledger"] == {"unacknowledged": 0, "orphans": 0}
        engine = create_engine(database_url)
        with session_factory(engine)() as db:
            report = usage_report(db, datetime.now(UTC).strftime("%Y-%m"))
        engine.dispose()
        assert sum(r.requests for r in report.rows) == len(rows) == 16
        assert sum(r.completion_tokens for r in report.rows) == sum(c for v in rows.values() for _, c in v)
    finally:
        cluster.stop()


async def test_a_spent_budget_survives_a_gateway_kill_and_a_redis_flush(
        tmp_path: Path, postgres_schema, cluster_env, redis_url: str) -> None:
    import redis as redis_sync

    database_url, _ = postgres_schema
    key = prepare_tenant(database_url, monthly_token_budget=300)
    cluster = Cluster.start(tmp_path, database_url, **cluster_env)
    headers = {"Authorization": f"Bearer {key}"}

    async def ask(url: str) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session, session.post(
                f"{url}/v1/chat/completions", headers=headers, json=chat(max_tokens=40)) as r:
            return r.status, await r.json()

    try:
        url = cluster.start_gateway()
        statuses = [(await ask(url))[0] for _ in range(8)]
        assert 200 in statuses and statuses[-1] == 429
        port = int(url.rsplit(":", 1)[1])
        cluster.kill_gateway(port)
        url = cluster.start_gateway(port)
        status, body = await ask(url)
        assert status == 429 and body["error"]["code"] == "insufficient_quota"
        client = redis_sync.from_url(redis_url)
        client.flushdb()  # Redis loses every quota key (FLUSHDB of the test database)
        client.close()
        status, body = await ask(url)
        assert status == 429 and body["error"]["code"] == "insufficient_quota"
    finally:
        cluster.stop()
