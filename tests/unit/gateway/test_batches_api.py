"""`/v1/batches` and the batch-line path of `/v1/chat/completions`, on the real gateway app in front
of a fake worker (ops.fake_worker), with a recording dispatcher in place of Celery."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from sqlalchemy import select, update

from accounting.db import create_db_engine, session_factory
from accounting.file_store import LocalFileStore
from accounting.files import create_file
from accounting.models import Batch, UsageEvent
from gateway.app import create_app
from gateway.batches.dispatch import BATCH_DISPATCHER
from gateway.settings import GatewaySettings
from gateway.state import SETTINGS
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from tests.unit.gateway.test_files_api import form
from tests.unit.gateway.test_gateway_api import MODEL, make_tenant_key

pytestmark = pytest.mark.asyncio
ADMIN = "test-admin-key"


def jsonl(n: int, url: str = "/v1/chat/completions") -> bytes:
    return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                                "body": {"model": MODEL, "max_tokens": 3,
                                         "messages": [{"role": "user", "content": "hi"}]}}).encode() + b"\n"
                    for i in range(n))


class RecordingDispatcher:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.fail = False

    def dispatch(self, batch_id: str) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.sent.append(batch_id)


class Env:
    def __init__(self, client, tmp_path: Path, worker: FakeWorker, dispatcher: RecordingDispatcher,
                 acme: str, globex: str, acme_id: int) -> None:
        self.client, self.worker, self.dispatcher = client, worker, dispatcher
        self.acme = {"Authorization": f"Bearer {acme}"}
        self.globex = {"Authorization": f"Bearer {globex}"}
        self.acme_key, self.acme_id = acme, acme_id
        self.url = f"sqlite:///{tmp_path}/tollway.db"
        self.home = tmp_path

    async def upload(self, data: bytes | None = None, headers: dict | None = None) -> str:
        response = await self.client.post("/v1/files", data=form(jsonl(3) if data is None else data),
                                          headers=headers or self.acme)
        assert response.status == 200, await response.text()
        return (await response.json())["id"]

    async def create(self, file_id: str, headers: dict | None = None, **fields) -> tuple[int, dict]:
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **fields}
        response = await self.client.post("/v1/batches", json=body, headers=headers or self.acme)
        return response.status, await response.json()

    def db(self, statement):
        engine = create_db_engine(self.url)
        try:
            with session_factory(engine)() as session, session.begin():
                if statement.is_select:
                    return list(session.scalars(statement))
                session.execute(statement)
                return None
        finally:
            engine.dispose()


@pytest_asyncio.fixture
async def env(aiohttp_client, aiohttp_server, tmp_path: Path) -> Env:
    worker = FakeWorker(context_length=256)
    server = await aiohttp_server(create_fake_worker_app(worker))
    url = f"sqlite:///{tmp_path}/tollway.db"
    acme_id, acme = make_tenant_key(url, "acme", rpm=1)
    _, globex = make_tenant_key(url, "globex")
    settings = GatewaySettings(home=tmp_path, worker_secret=FAKE_WORKER_SECRET, worker_urls=str(server.make_url("")).rstrip("/"), admin_key=ADMIN,
                               health_interval_s=0.2)
    app = create_app(settings)
    dispatcher = RecordingDispatcher()
    app[BATCH_DISPATCHER] = dispatcher
    client = await aiohttp_client(app)
    return Env(client, tmp_path, worker, dispatcher, acme, globex, acme_id)


async def test_create_retrieve_list_cancel(env: Env) -> None:
    file_id = await env.upload()
    status, batch = await env.create(file_id, metadata={"team": "search"})
    assert status == 200, batch
    assert batch["status"] == "validating" and batch["object"] == "batch" and batch["input_file_id"] == file_id
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert batch["metadata"] == {"team": "search"} and batch["errors"] is None
    assert env.dispatcher.sent == [batch["id"]]
    [row] = env.db(select(Batch).where(Batch.id == batch["id"]))
    assert row.dispatched_at is not None and row.estimated_tokens > 0

    fetched = await (await env.client.get(f"/v1/batches/{batch['id']}", headers=env.acme)).json()
    assert fetched["id"] == batch["id"] and fetched["usage"]["total_tokens"] == 0

    second = (await env.create(await env.upload()))[1]
    page = await (await env.client.get("/v1/batches", params={"limit": "1"}, headers=env.acme)).json()
    assert [b["id"] for b in page["data"]] == [second["id"]] and page["has_more"] is True
    assert page["first_id"] == page["last_id"] == second["id"]
    rest = await (await env.client.get("/v1/batches", params={"after": page["last_id"]}, headers=env.acme)).json()
    assert [b["id"] for b in rest["data"]] == [batch["id"]] and rest["has_more"] is False

    cancelled = await env.client.post(f"/v1/batches/{batch['id']}/cancel", headers=env.acme)
    assert cancelled.status == 200 and (await cancelled.json())["status"] == "cancelling"
    assert (await (await env.client.post(f"/v1/batches/{batch['id']}/cancel", headers=env.acme)).json())[
        "status"] == "cancelling"
    env.db(update(Batch).where(Batch.id == second["id"]).values(status="completed"))
    refused = await env.client.post(f"/v1/batches/{second['id']}/cancel", headers=env.acme)
    assert refused.status == 409 and (await refused.json())["error"]["code"] == "batch_not_cancellable"


@pytest.mark.parametrize(("body", "param"), [
    ({"endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": 7, "endpoint": "/v1/chat/completions", "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": "FILE", "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": "FILE", "endpoint": "/v1/chat/completions"}, "completion_window"),
])
async def test_missing_fields_are_400s_naming_them(env: Env, body: dict, param: str) -> None:
    file_id = await env.upload()
    body = {k: file_id if v == "FILE" else v for k, v in body.items()}
    response = await env.client.post("/v1/batches", json=body, headers=env.acme)
    assert response.status == 400
    assert (await response.json())["error"]["param"] == param


@pytest.mark.parametrize("fields", [{"endpoint": "/v1/embeddings"}, {"completion_window": "1h"},
                                    {"metadata": {"k": 1}}, {"metadata": "x"}])
async def test_bad_values_are_400s(env: Env, fields: dict) -> None:
    status, body = await env.create(await env.upload(), **fields)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert env.dispatcher.sent == []


async def test_bad_bodies_and_unknown_files(env: Env) -> None:
    for raw in (b"{nope", b"[1]"):
        response = await env.client.post("/v1/batches", data=raw, headers=env.acme)
        assert response.status == 400
    status, body = await env.create("file-doesnotexist")
    assert status == 404 and body["error"]["code"] == "file_not_found" and body["error"]["param"] == "input_file_id"
    status, body = await env.create(await env.upload(), headers=env.globex)  # acme's file
    assert status == 404
    engine = create_db_engine(env.url)
    with session_factory(engine)() as session, session.begin():
        output = create_file(session, LocalFileStore(env.home / "files"), env.acme_id, "o.jsonl", "batch_output",
                             jsonl(1)).id
    engine.dispose()
    status, body = await env.create(output)
    assert status == 400 and "purpose" in body["error"]["message"]
    for path in ("/v1/batches/batch_nope", "/v1/batches/batch_nope/cancel"):
        method = "POST" if path.endswith("cancel") else "GET"
        response = await env.client.request(method, path, headers=env.acme)
        assert response.status == 404 and (await response.json())["error"]["code"] == "batch_not_found"
    assert (await env.client.get("/v1/batches", params={"limit": "0"}, headers=env.acme)).status == 400
    assert (await env.client.get("/v1/batches", params={"limit": "x"}, headers=env.acme)).status == 400
    assert (await env.client.get("/v1/batches", params={"after": "batch_x"}, headers=env.acme)).status == 400
    assert (await env.client.get("/v1/batches")).status == 401


async def test_another_tenants_batch_is_not_found(env: Env) -> None:
    _, batch = await env.create(await env.upload())
    for method, path in (("GET", f"/v1/batches/{batch['id']}"), ("POST", f"/v1/batches/{batch['id']}/cancel")):
        assert (await env.client.request(method, path, headers=env.globex)).status == 404
    assert (await (await env.client.get("/v1/batches", headers=env.globex)).json())["data"] == []
    assert (await (await env.client.get(f"/v1/batches/{batch['id']}", headers=env.acme)).json())[
        "status"] == "validating"  # untouched


async def test_invalid_input_makes_a_failed_batch_naming_lines(env: Env) -> None:
    status, batch = await env.create(await env.upload(), endpoint="/v1/completions")
    assert status == 200 and batch["status"] == "failed" and batch["failed_at"] is not None
    assert batch["errors"]["data"][0]["code"] == "mismatched_endpoint" and batch["errors"]["data"][0]["line"] == 1
    file_id = await env.upload()
    env.client.app[SETTINGS].max_batch_lines = 2  # the limit was lowered after the upload
    status, batch = await env.create(file_id)
    assert batch["status"] == "failed" and "too many lines" in batch["errors"]["data"][0]["message"]
    assert env.dispatcher.sent == []


async def test_queued_batch_tokens_limit_is_a_429(env: Env) -> None:
    env.client.app[SETTINGS].max_queued_batch_tokens = 50
    file_id = await env.upload()
    assert (await env.create(file_id))[0] == 200  # 3 lines × ~13 tokens
    status, body = await env.create(file_id)
    assert status == 429 and body["error"]["code"] == "queued_batch_tokens_exceeded"
    assert "queued batch tokens" in body["error"]["message"]
    assert len(env.dispatcher.sent) == 1


async def test_a_broker_outage_leaves_the_batch_for_the_sweep(env: Env) -> None:
    env.dispatcher.fail = True
    status, batch = await env.create(await env.upload())
    assert status == 200 and batch["status"] == "validating"
    [row] = env.db(select(Batch).where(Batch.id == batch["id"]))
    assert row.dispatched_at is None  # what the sweep looks for


def batch_line(batch_id: str, **fields) -> dict:
    return {"json": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields},
            "headers": {"Authorization": f"Bearer {ADMIN}", "X-Tollway-Batch-Id": batch_id}}


async def test_batch_lines_run_at_batch_priority_billed_to_the_batch_outside_rpm(env: Env) -> None:
    _, batch = await env.create(await env.upload())
    env.db(update(Batch).where(Batch.id == batch["id"]).values(status="in_progress"))
    for _ in range(3):  # acme's rpm is 1: batch lines do not count
        response = await env.client.post("/v1/chat/completions", **batch_line(batch["id"]))
        assert response.status == 200, await response.text()
        assert "x-ratelimit-limit-requests" not in response.headers
    assert [r["priority"] for r in env.worker.requests] == ["batch"] * 3
    assert {r["namespace"] for r in env.worker.requests} == {f"tenant-{env.acme_id}"}
    rows = env.db(select(UsageEvent).where(UsageEvent.batch_id == batch["id"]))
    assert len(rows) == 3 and {r.tenant_id for r in rows} == {env.acme_id}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert (await env.client.post("/v1/chat/completions", json=chat, headers=env.acme)).status == 200
    assert (await env.client.post("/v1/chat/completions", json=chat, headers=env.acme)).status == 429
    assert env.worker.requests[-1]["priority"] == "interactive"


async def test_batch_lines_reserve_against_the_tenants_monthly_budget(env: Env) -> None:
    _, batch = await env.create(await env.upload())
    env.db(update(Batch).where(Batch.id == batch["id"]).values(status="in_progress"))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert (await env.client.post("/v1/chat/completions", json=chat, headers=env.acme)).status == 200  # month seeded
    # No budget yet: the line is still counted, so that a budget set later starts from the month's real spend.
    assert (await env.client.post("/v1/chat/completions", **batch_line(batch["id"]))).status == 200
    [first] = env.db(select(UsageEvent).where(UsageEvent.batch_id == batch["id"]))
    spent = sum(r.prompt_tokens + r.completion_tokens for r in env.db(select(UsageEvent)))
    reserve = first.prompt_tokens + 3  # max_tokens 3
    budget = await env.client.patch("/admin/v1/tenants/acme", headers={"Authorization": f"Bearer {ADMIN}"},
                                    json={"monthly_token_budget": spent + reserve})  # drops cached keys too
    assert budget.status == 200, await budget.text()
    second = await env.client.post("/v1/chat/completions", **batch_line(batch["id"]))  # fits: spent + reserve
    assert second.status == 200, await second.text()
    assert "x-ratelimit-limit-requests" not in second.headers  # the interactive limits still do not apply
    sent = len(env.worker.requests)
    third = await env.client.post("/v1/chat/completions", **batch_line(batch["id"]))  # 2 x spent + reserve: over
    assert third.status == 429 and third.headers["x-should-retry"] == "false"
    assert (await third.json())["error"]["code"] == "insufficient_quota"
    assert len(env.worker.requests) == sent  # refused before any worker
    interactive = await env.client.post("/v1/chat/completions", json=chat, headers=env.acme)
    assert interactive.status == 429  # the batch lines spent the budget the tenant's own requests share
    assert (await interactive.json())["error"]["code"] == "insufficient_quota"


async def test_batch_lines_are_refused_unless_a_runner_may_send_them(env: Env) -> None:
    _, batch = await env.create(await env.upload())
    line = batch_line(batch["id"])
    assert (await env.client.post("/v1/chat/completions", **line)).status == 409  # still validating
    env.db(update(Batch).where(Batch.id == batch["id"]).values(status="in_progress"))
    tenant = {**line, "headers": {**line["headers"], "Authorization": env.acme["Authorization"]}}
    assert (await env.client.post("/v1/chat/completions", **tenant)).status == 401  # a tenant key is not enough
    unknown = batch_line("batch_nope")
    assert (await env.client.post("/v1/chat/completions", **unknown)).status == 404
    assert (await env.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                                  headers=line["headers"])).status == 400  # not the batch's endpoint
    streamed = await env.client.post("/v1/chat/completions", **batch_line(batch["id"], stream=True))
    assert streamed.status == 400 and (await streamed.json())["error"]["param"] == "stream"
    assert env.worker.requests == []


async def test_a_retried_batch_line_is_answered_once_and_billed_once(env: Env) -> None:
    _, batch = await env.create(await env.upload())
    env.db(update(Batch).where(Batch.id == batch["id"]).values(status="cancelling"))  # in-flight lines finish
    line = batch_line(batch["id"])
    line["headers"]["Idempotency-Key"] = f"{batch['id']}:1"
    first = await (await env.client.post("/v1/chat/completions", **line)).json()
    again = await env.client.post("/v1/chat/completions", **line)
    assert again.headers.get("Idempotent-Replayed") == "true" and await again.json() == first
    assert len(env.db(select(UsageEvent).where(UsageEvent.batch_id == batch["id"]))) == 1


async def test_the_openai_sdk_creates_retrieves_lists_and_cancels(env: Env) -> None:
    client = openai.AsyncOpenAI(base_url=str(env.client.make_url("/v1")), api_key=env.acme_key, max_retries=0)
    uploaded = await client.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"a": "b"})
    assert batch.status == "validating" and batch.request_counts.total == 2
    assert (await client.batches.retrieve(batch.id)).id == batch.id
    assert [b.id async for b in client.batches.list(limit=10)] == [batch.id]
    assert (await client.batches.cancel(batch.id)).status == "cancelling"
    with pytest.raises(openai.NotFoundError):
        await client.batches.retrieve("batch_nope")
    await client.close()

