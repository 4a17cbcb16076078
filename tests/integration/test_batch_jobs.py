"""Batch jobs on real Celery workers (Redis broker) behind a real gateway process with a fake engine
worker (ops.fake_worker: these tests are about the jobs, not the model), PostgreSQL accounting.

A worker is SIGKILLed mid-batch; a second one (with the beat sweep) takes the batch over once the
first one's lease lapses: the output still has each custom_id exactly once, and the usage rows
that were answered (`ok`) are exactly the output's lines."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.integration.gateway_cluster import Cluster, prepare_tenant

pytestmark = pytest.mark.services
MODEL = "smollm2-135m-instruct"
LINES = 60


def http(method: str, url: str, key: str, body: bytes | None = None, content_type: str = "application/json") -> bytes:
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def upload(base: str, key: str, data: bytes) -> str:
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return json.loads(http("POST", f"{base}/v1/files", key, body, f"multipart/form-data; boundary={boundary}"))["id"]


def start_celery(cluster: Cluster, gateway: str, name: str, *extra: str, **env: str) -> subprocess.Popen[bytes]:
    log = (cluster.home / f"celery-{name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.jobs.app", "worker", "-P", "threads", "-c", "1",
         "-Q", "tollway.batches", "-n", f"{name}@%h", "-l", "INFO", "--without-gossip", "--without-mingle", *extra],
        env={**cluster.env, "TOLLWAY_GATEWAY_URL": gateway, "TOLLWAY_BATCH_LEASE_S": "3",
             "TOLLWAY_BATCH_LINE_CONCURRENCY": "4", **env},
        stdout=log, stderr=subprocess.STDOUT)


def stop_celery(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()


def wait_batch(base: str, key: str, batch_id: str, done, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = json.loads(http("GET", f"{base}/v1/batches/{batch_id}", key))
        if done(batch):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not there within {timeout_s} s: {batch}")


def test_a_killed_celery_worker_loses_and_repeats_nothing(tmp_path: Path, redis_url: str,
                                                         postgres_schema: tuple[str, str]) -> None:
    import redis

    redis.from_url(redis_url).delete("tollway.batches")  # run tasks of earlier test runs: not ours
    database_url, _ = postgres_schema
    key = prepare_tenant(database_url)
    cluster = Cluster.start(tmp_path, database_url, delay_s=0.1, TOLLWAY_REDIS_URL=redis_url,
                            TOLLWAY_QUOTA_PREFIX=f"test-{uuid.uuid4().hex[:8]}")
    workers: list[subprocess.Popen[bytes]] = []
    try:
        base = cluster.start_gateway()
        lines = b"".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": MODEL, "max_tokens": 3,
                                              "messages": [{"role": "user", "content": f"q{i}"}]}}).encode() + b"\n"
                         for i in range(LINES))
        body = json.dumps({"input_file_id": upload(base, key, lines), "endpoint": "/v1/chat/completions",
                           "completion_window": "24h"}).encode()
        batch_id = json.loads(http("POST", f"{base}/v1/batches", key, body))["id"]

        workers.append(start_celery(cluster, base, "first"))
        wait_batch(base, key, batch_id, lambda b: b["request_counts"]["completed"] >= 10, 60)
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait(10)
        halfway = json.loads(http("GET", f"{base}/v1/batches/{batch_id}", key))
        assert halfway["status"] == "in_progress" and halfway["request_counts"]["completed"] < LINES

        workers.append(start_celery(cluster, base, "second", "-B", "-s", str(tmp_path / "beat-schedule"),
                                    TOLLWAY_BATCH_SWEEP_INTERVAL_S="1"))
        batch = wait_batch(base, key, batch_id, lambda b: b["status"] not in ("in_progress", "finalizing"), 120)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
        assert batch["error_file_id"] is None

        output = [json.loads(line) for line in
                  http("GET", f"{base}/v1/files/{batch['output_file_id']}/content", key).splitlines()]
        assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(LINES))
        request_ids = [o["response"]["request_id"] for o in output]
        assert len(set(request_ids)) == LINES

        engine = create_engine(database_url)
        with engine.connect() as connection:
            rows = connection.execute(text("SELECT request_id, status, completion_tokens FROM usage_events "
                                           "WHERE batch_id = :b"), {"b": batch_id}).all()
        engine.dispose()
        answered = {r.request_id: r for r in rows if r.status == "ok"}
        assert set(answered) == set(request_ids)  # every answered line billed once, and only those
        assert sum(r.completion_tokens for r in answered.values()) == batch["usage"]["output_tokens"]
        # Lines in flight at the kill were cut off at the gateway: billed for what ran, never answered.
        assert all(r.status == "client_disconnected" for r in rows if r.request_id not in answered)
        assert len(rows) - len(answered) <= 4  # at most one per line in flight (concurrency 4)
    finally:
        for worker in workers:
            stop_celery(worker)
        cluster.stop()


def test_a_batch_stops_spending_at_the_tenants_monthly_budget(tmp_path: Path, redis_url: str,
                                                             postgres_schema: tuple[str, str]) -> None:
    """Lines reserve against the budget on the Redis quota store: those it cannot fit end in the error
    file as insufficient_quota (not retried), and the month's tokens stay within the budget."""
    database_url, _ = postgres_schema
    key = prepare_tenant(database_url)
    cluster = Cluster.start(tmp_path, database_url, TOLLWAY_REDIS_URL=redis_url,
                            TOLLWAY_QUOTA_PREFIX=f"test-{uuid.uuid4().hex[:8]}")
    worker: subprocess.Popen[bytes] | None = None
    total = 20

    def line(i: int) -> dict:
        return {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": f"q{i % 10}"}]}

    try:
        base = cluster.start_gateway()
        probe = json.loads(http("POST", f"{base}/v1/chat/completions", key, json.dumps(line(0)).encode()))
        reserve = probe["usage"]["prompt_tokens"] + 3  # what each line reserves (its prompt + max_tokens)
        budget = probe["usage"]["total_tokens"] + 6 * reserve  # six lines fit whatever they settle to
        http("PATCH", f"{base}/admin/v1/tenants/acme", "tw-admin-test",
             json.dumps({"monthly_token_budget": budget}).encode())
        lines = b"".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": line(i)}).encode() + b"\n" for i in range(total))
        body = json.dumps({"input_file_id": upload(base, key, lines), "endpoint": "/v1/chat/completions",
                           "completion_window": "24h"}).encode()
        batch_id = json.loads(http("POST", f"{base}/v1/batches", key, body))["id"]
        worker = start_celery(cluster, base, "budget")
        batch = wait_batch(base, key, batch_id, lambda b: b["status"] not in ("validating", "in_progress",
                                                                             "finalizing"), 90)
        counts = batch["request_counts"]
        assert batch["status"] == "completed" and counts["total"] == total, batch
        assert 6 <= counts["completed"] < total and counts["completed"] + counts["failed"] == total
        errors = [json.loads(e) for e in
                  http("GET", f"{base}/v1/files/{batch['error_file_id']}/content", key).splitlines()]
        assert len(errors) == counts["failed"]
        assert all(e["response"]["status_code"] == 429 and
                   e["response"]["body"]["error"]["code"] == "insufficient_quota" for e in errors)
        engine = create_engine(database_url)
        with engine.connect() as connection:
            spent = connection.execute(text("SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) "
                                            "FROM usage_events")).scalar_one()
        engine.dispose()
        assert spent <= budget
    finally:
        if worker is not None:
            stop_celery(worker)
        cluster.stop()
