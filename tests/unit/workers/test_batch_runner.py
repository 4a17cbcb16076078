"""workers/jobs/runner.py against a real gateway app (on a local port) in front of a fake worker:
lines run through the gateway's own routes, results are recorded once, and batches complete, cancel,
expire and continue as specified. (Celery itself is exercised by tests/integration/test_batch_jobs.py.)"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path

import pytest
import pytest_asyncio
from sqlalchemy import select, update

from accounting import batch_runs
from accounting.db import create_db_engine, session_factory
from accounting.file_store import LocalFileStore
from accounting.files import read_file_content
from accounting.models import Batch, UsageEvent, utcnow
from gateway.app import create_app
from gateway.batches.dispatch import BATCH_DISPATCHER
from gateway.settings import GatewaySettings
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from tests.unit.gateway.test_batches_api import ADMIN, RecordingDispatcher
from tests.unit.gateway.test_files_api import form
from tests.unit.gateway.test_gateway_api import MODEL, make_tenant_key
from workers.jobs.runner import BatchStep, RunnerConfig

pytestmark = pytest.mark.asyncio


def jsonl(n: int, model: str = MODEL) -> bytes:
    return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": model if i != 2 else "no-such-model", "max_tokens": 3,
                                         "messages": [{"role": "user", "content": f"line {i}"}]}}).encode() + b"\n"
                    for i in range(n))


class Env:
    def __init__(self, client, worker: FakeWorker, tmp_path: Path, key: str) -> None:
        self.client, self.worker, self.tmp_path = client, worker, tmp_path
        self.auth = {"Authorization": f"Bearer {key}"}
        self.engine = create_db_engine(f"sqlite:///{tmp_path}/tollway.db")
        self.sessions = session_factory(self.engine)
        self.store = LocalFileStore(tmp_path / "files")
        self.runs = 0

    async def create(self, lines: int) -> str:
        upload = await self.client.post("/v1/files", data=form(jsonl(lines)), headers=self.auth)
        body = {"input_file_id": (await upload.json())["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}
        return (await (await self.client.post("/v1/batches", json=body, headers=self.auth)).json())["id"]

    def step(self, batch_id: str, admin_key: str = ADMIN, **config) -> BatchStep:
        self.runs += 1
        settings = RunnerConfig(gateway_url=str(self.client.make_url("")).rstrip("/"), admin_key=admin_key,
                                **{"concurrency": 4, "lease_s": 30, **config})
        return BatchStep(batch_id, f"test-runner-{self.runs}", self.sessions, self.store, settings)

    def batch(self, batch_id: str) -> Batch:
        with self.sessions() as session:
            return session.get(Batch, batch_id)

    def sql(self, statement) -> list:
        with self.sessions() as session, session.begin():
            if statement.is_select:
                return list(session.scalars(statement))
            session.execute(statement)
            return []

    def lines(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        with self.sessions() as session:
            data = read_file_content(session, self.store, self.batch_file_tenant(file_id), file_id)
        return [json.loads(line) for line in data.splitlines()]

    def batch_file_tenant(self, file_id: str) -> int:
        from accounting.models import File

        with self.sessions() as session:
            return session.get(File, file_id).tenant_id


@pytest_asyncio.fixture
async def env(aiohttp_client, aiohttp_server, tmp_path: Path):
    worker = FakeWorker(context_length=256)
    server = await aiohttp_server(create_fake_worker_app(worker))
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db", "acme")
    settings = GatewaySettings(home=tmp_path, worker_secret=FAKE_WORKER_SECRET, worker_urls=str(server.make_url("")).rstrip("/"), admin_key=ADMIN,
                               health_interval_s=0.2)
    app = create_app(settings)
    app[BATCH_DISPATCHER] = RecordingDispatcher()
    environment = Env(await aiohttp_client(app), worker, tmp_path, key)
    yield environment
    environment.engine.dispose()


async def test_a_batch_runs_to_completed_through_the_gateway(env: Env) -> None:
    batch_id = await env.create(6)
    assert await env.step(batch_id).run() == "ended"
    batch = env.batch(batch_id)
    assert batch.status == "completed" and batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert (batch.total, batch.completed, batch.failed) == (6, 5, 1)  # line 3 names an unknown model
    assert batch.runner_id is None and batch.lease_until is None
    output, errors = env.lines(batch.output_file_id), env.lines(batch.error_file_id)
    assert [o["custom_id"] for o in output] == ["c0", "c1", "c3", "c4", "c5"]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    assert output[0]["response"]["body"]["object"] == "chat.completion"
    [error] = errors
    assert error["custom_id"] == "c2" and error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"]["code"] == "model_not_found"
    assert [r["priority"] for r in env.worker.requests] == ["batch"] * 5
    usage = env.sql(select(UsageEvent).where(UsageEvent.batch_id == batch_id))
    assert sorted(u.request_id for u in usage) == sorted(o["response"]["request_id"] for o in output)

    assert await env.step(batch_id).run() == "busy"  # a duplicate delivery: the batch has ended
    assert len(env.worker.requests) == 5


async def test_a_recorded_line_is_never_run_again(env: Env) -> None:
    batch_id = await env.create(4)
    env.sql(update(Batch).where(Batch.id == batch_id).values(status="in_progress"))
    with env.sessions() as session, session.begin():  # a previous runner recorded line 1, then died
        batch_runs.record_result(session, batch_id, batch_runs.LineResult.from_response(
            1, "c0", 200, {"id": "chatcmpl-earlier", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}))
    assert await env.step(batch_id).run() == "ended"
    assert len(env.worker.requests) == 2  # lines 2 and 4 (line 3's model is unknown: no worker call)
    output = env.lines(env.batch(batch_id).output_file_id)
    assert [o["custom_id"] for o in output] == ["c0", "c1", "c3"]
    assert output[0]["response"]["request_id"] == "chatcmpl-earlier"


async def test_a_second_runner_is_kept_out_while_the_lease_holds(env: Env) -> None:
    batch_id = await env.create(3)
    with env.sessions() as session, session.begin():
        assert batch_runs.claim(session, batch_id, "someone-else", lease_s=30) is not None
    assert await env.step(batch_id).run() == "busy"
    assert env.worker.requests == [] and env.batch(batch_id).status == "validating"


async def test_cancel_mid_batch_keeps_finished_lines_and_runs_no_more(env: Env) -> None:
    env.worker.delay_s = 0.1  # 0.3 s a line
    batch_id = await env.create(12)
    run = asyncio.create_task(env.step(batch_id, concurrency=1).run())
    while env.batch(batch_id).completed < 2:
        await asyncio.sleep(0.05)
    cancel = await env.client.post(f"/v1/batches/{batch_id}/cancel", headers=env.auth)
    assert (await cancel.json())["status"] == "cancelling"
    assert await asyncio.wait_for(run, 30) == "ended"
    batch = env.batch(batch_id)
    assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at
    assert batch.completed + batch.failed == 12 and batch.completed < 10
    output, errors = env.lines(batch.output_file_id), env.lines(batch.error_file_id)
    assert len(output) == batch.completed and len(env.worker.requests) == batch.completed
    cancelled = [e for e in errors if e["error"] and e["error"]["code"] == "batch_cancelled"]
    assert cancelled and all(e["response"] is None for e in cancelled)
    assert sorted(o["custom_id"] for o in output + errors) == sorted(f"c{i}" for i in range(12))


async def test_an_expired_batch_ends_expired_with_what_finished(env: Env) -> None:
    batch_id = await env.create(3)
    env.sql(update(Batch).where(Batch.id == batch_id).values(expires_at=utcnow() - timedelta(seconds=1)))
    assert await env.step(batch_id).run() == "ended"
    batch = env.batch(batch_id)
    assert batch.status == "expired" and batch.expired_at and batch.output_file_id is None
    errors = env.lines(batch.error_file_id)
    assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 3 and env.worker.requests == []


async def test_expiry_while_running_stops_starting_lines(env: Env) -> None:
    env.worker.delay_s = 0.1
    batch_id = await env.create(20)
    env.sql(update(Batch).where(Batch.id == batch_id).values(expires_at=utcnow() + timedelta(seconds=1.5)))
    assert await env.step(batch_id, concurrency=1).run() == "ended"
    batch = env.batch(batch_id)
    assert batch.status == "expired" and 0 < batch.completed < 19 and batch.completed + batch.failed == 20


async def test_a_step_that_runs_out_of_time_hands_over_to_a_continuation(env: Env) -> None:
    env.worker.delay_s = 0.1
    batch_id = await env.create(10)
    assert await env.step(batch_id, concurrency=1, step_s=1.0).run() == "continue"
    batch = env.batch(batch_id)
    assert batch.status == "in_progress" and batch.runner_id is None and 0 < batch.completed < 9
    env.worker.delay_s = 0.0
    assert await env.step(batch_id).run() == "ended"
    assert env.batch(batch_id).status == "completed" and len(env.worker.requests) == 9


async def test_a_runner_the_gateway_refuses_records_nothing_and_retries_later(env: Env) -> None:
    batch_id = await env.create(3)
    assert await env.step(batch_id, admin_key="wrong").run() == "retry_later"
    batch = env.batch(batch_id)
    assert batch.completed == batch.failed == 0 and batch.runner_id is None and batch.status == "in_progress"
