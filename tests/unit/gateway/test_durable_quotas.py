"""Through the real gateway app: a monthly budget spent before a restart stays spent (the quota
store is seeded from usage_events), and a key's own rpm is enforced on that key, within its
tenant's limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from accounting.api_keys import create_key
from accounting.db import create_db_engine, session_factory
from ops.fake_worker import FakeWorker, create_fake_worker_app
from tests.unit.gateway.test_gateway_api import chat, make_tenant_key, start_gateway

pytestmark = pytest.mark.asyncio


async def test_a_spent_budget_stays_spent_after_a_restart(aiohttp_client, aiohttp_server, tmp_path: Path) -> None:
    worker_url = str((await aiohttp_server(create_fake_worker_app(FakeWorker()))).make_url("")).rstrip("/")
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db", monthly_token_budget=300)
    auth = {"Authorization": f"Bearer {key}"}
    first = await start_gateway(aiohttp_client, tmp_path, [worker_url])
    statuses = [(await first.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=40))).status
                for _ in range(8)]
    assert 200 in statuses and statuses[-1] == 429  # spent within this process
    await first.close()

    restarted = await start_gateway(aiohttp_client, tmp_path, [worker_url])  # same database, fresh memory
    refused = await restarted.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=40))
    body = await refused.json()
    assert refused.status == 429 and body["error"]["code"] == "insufficient_quota"


async def test_a_keys_own_rpm_is_enforced_on_that_key(aiohttp_client, aiohttp_server, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/tollway.db"
    worker_url = str((await aiohttp_server(create_fake_worker_app(FakeWorker()))).make_url("")).rstrip("/")
    _, roomy = make_tenant_key(url, rpm=10)
    engine = create_db_engine(url)
    with session_factory(engine)() as session, session.begin():
        _, tight = create_key(session, "acme", name="ci", rpm=1)
    engine.dispose()
    client = await start_gateway(aiohttp_client, tmp_path, [worker_url])
    tight_auth, roomy_auth = {"Authorization": f"Bearer {tight}"}, {"Authorization": f"Bearer {roomy}"}
    assert (await client.post("/v1/chat/completions", headers=tight_auth, json=chat())).status == 200
    refused = await client.post("/v1/chat/completions", headers=tight_auth, json=chat())
    assert refused.status == 429 and refused.headers["x-ratelimit-limit-requests"] == "1"
    # The tenant's other key is not held back by the tight key's count...
    answers = [await client.post("/v1/chat/completions", headers=roomy_auth, json=chat()) for _ in range(9)]
    assert [a.status for a in answers] == [200] * 9
    # ...and the tenant's own limit (10 a minute, 1 used by the tight key) still holds for both.
    assert (await client.post("/v1/chat/completions", headers=roomy_auth, json=chat())).status == 429
