"""accounting.batches / batch_runs / batch_output on a real (SQLite) database migrated by Alembic:
the state machine, validation, tenant scoping, leases, idempotent results, cancel, expiry and the
OpenAI format of the output and error files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from accounting import batch_output, batch_runs, batches
from accounting.batch_input import BatchInputError, validate_batch_input
from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.file_store import LocalFileStore
from accounting.files import create_file, read_file_content
from accounting.models import Batch, utcnow
from accounting.tenants import create_tenant

URL = "/v1/chat/completions"


def jsonl(n: int, url: str = URL, max_tokens: int = 5) -> bytes:
    return b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                                "body": {"model": "m", "max_tokens": max_tokens,
                                         "messages": [{"role": "user", "content": "hi"}]}}).encode() + b"\n"
                    for i in range(n))


@pytest.fixture
def db(tmp_path: Path) -> Iterator[tuple[Session, LocalFileStore, int, int]]:
    """(session, store, acme's tenant id, globex's tenant id); the session commits nothing."""
    engine = create_db_engine(f"sqlite:///{tmp_path}/t.db")
    upgrade_database(engine)
    with session_factory(engine)() as session:
        acme, globex = create_tenant(session, "acme"), create_tenant(session, "globex")
        yield session, LocalFileStore(tmp_path / "files"), acme.id, globex.id
    engine.dispose()


def make_batch(session: Session, store: LocalFileStore, tenant_id: int, data: bytes | None = None,
               endpoint: str = URL, max_queued_tokens: int = 0) -> Batch:
    data = jsonl(3) if data is None else data
    upload = create_file(session, store, tenant_id, "in.jsonl", "batch", data)
    try:
        parsed = validate_batch_input(data, max_lines=100, max_bytes=10**6)
    except BatchInputError as exc:
        parsed = exc
    return batches.create_batch(session, tenant_id=tenant_id, key_id=None, input_file_id=upload.id,
                                endpoint=endpoint, completion_window="24h", metadata={"k": "v"},
                                parsed=parsed, max_queued_tokens=max_queued_tokens)


def test_a_new_batch_is_validating_with_its_counts_and_window(db) -> None:
    session, store, acme, _ = db
    batch = make_batch(session, store, acme)
    assert batch.id.startswith("batch_") and batch.status == "validating"
    assert batch.total == 3 and batch.completed == batch.failed == 0
    assert batch.expires_at - batch.created_at == timedelta(hours=24)
    body = batches.batch_to_dict(batch)
    assert body["object"] == "batch" and body["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert body["errors"] is None and body["metadata"] == {"k": "v"} and isinstance(body["created_at"], int)
    assert body["in_progress_at"] is None and body["expires_at"] == body["created_at"] + 86400


def test_invalid_input_or_mismatched_endpoint_fails_the_batch_naming_lines(db) -> None:
    session, store, acme, _ = db
    bad = jsonl(2) + b"{oops\n" + jsonl(1)  # line 3 is not JSON, line 4 repeats custom_id c0
    batch = make_batch(session, store, acme, data=bad)
    assert batch.status == "failed" and batch.failed_at is not None
    errors = batches.batch_to_dict(batch)["errors"]
    assert errors["object"] == "list"
    assert [(e["line"], e["code"]) for e in errors["data"]] == [(3, "invalid_input_line"), (4, "invalid_input_line")]
    assert "duplicate custom_id 'c0'" in errors["data"][1]["message"]

    mismatch = make_batch(session, store, acme, data=jsonl(2, url="/v1/completions"))
    assert mismatch.status == "failed"
    [error] = mismatch.errors_json or []
    assert error["code"] == "mismatched_endpoint" and error["line"] == 1


@pytest.mark.parametrize(("field", "value"), [
    ("endpoint", "/v1/embeddings"), ("completion_window", "1h"), ("metadata", {"k": 1}),
    ("metadata", {f"k{i}": "v" for i in range(17)}), ("metadata", ["x"]),
])
def test_bad_parameters_are_refused(db, field: str, value: object) -> None:
    session, store, acme, _ = db
    upload = create_file(session, store, acme, "in.jsonl", "batch", jsonl(1))
    params = {"endpoint": URL, "completion_window": "24h", "metadata": None} | {field: value}
    with pytest.raises(batches.InvalidBatchError):
        batches.create_batch(session, tenant_id=acme, key_id=None, input_file_id=upload.id,
                             parsed=validate_batch_input(jsonl(1), max_lines=9, max_bytes=10**6),
                             max_queued_tokens=0, **params)


def test_another_tenants_file_and_batch_are_not_found(db) -> None:
    session, store, acme, globex = db
    batch = make_batch(session, store, acme)
    with pytest.raises(batches.BatchNotFound):
        batches.get_batch(session, globex, batch.id)
    with pytest.raises(batches.BatchNotFound):
        batches.cancel_batch(session, globex, batch.id)
    assert batches.list_batches(session, globex) == ([], False)
    from accounting.files import FileNotFound

    with pytest.raises(FileNotFound):
        batches.create_batch(session, tenant_id=globex, key_id=None, input_file_id=batch.input_file_id,
                             endpoint=URL, completion_window="24h", metadata=None,
                             parsed=validate_batch_input(jsonl(1), max_lines=9, max_bytes=10**6),
                             max_queued_tokens=0)


def test_queued_batch_tokens_are_limited_per_tenant(db) -> None:
    session, store, acme, globex = db
    one = batches.estimate_line_tokens({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert one == len(json.dumps([{"role": "user", "content": "hi"}])) // 3 + 1 + 5
    assert batches.estimate_line_tokens({"prompt": "x", "n": 2}) == 2 + 2 * batches.DEFAULT_COMPLETION_ESTIMATE
    first = make_batch(session, store, acme, max_queued_tokens=3 * one)
    assert first.estimated_tokens == 3 * one and batches.queued_tokens(session, acme) == 3 * one
    with pytest.raises(batches.QueuedTokensExceeded, match="already hold"):
        make_batch(session, store, acme, max_queued_tokens=4 * one)
    make_batch(session, store, globex, max_queued_tokens=3 * one)  # another tenant: its own limit
    first.status = "completed"  # an ended batch no longer counts
    session.flush()
    make_batch(session, store, acme, max_queued_tokens=3 * one)


def test_state_machine_allows_only_its_transitions(db) -> None:
    session, store, acme, _ = db
    batch = make_batch(session, store, acme)
    for bad in ("completed", "finalizing", "cancelled", "validating"):
        with pytest.raises(batches.BatchStateError):
            batches.transition(batch, bad)
    batches.transition(batch, "in_progress")
    batches.transition(batch, "finalizing")
    batches.transition(batch, "completed")
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    for status in (*batches.UNFINISHED, *batches.TERMINAL):  # a terminal state is final
        with pytest.raises(batches.BatchStateError):
            batches.transition(batch, status)


def test_cancel_is_idempotent_and_refused_once_ended(db) -> None:
    session, store, acme, _ = db
    batch = make_batch(session, store, acme)
    assert batches.cancel_batch(session, acme, batch.id).status == "cancelling"
    assert batches.cancel_batch(session, acme, batch.id).status == "cancelling"
    done = make_batch(session, store, acme)
    batches.transition(done, "in_progress")
    batches.transition(done, "finalizing")
    with pytest.raises(batches.BatchStateError, match="cannot be cancelled"):
        batches.cancel_batch(session, acme, done.id)


def test_listing_pages_newest_first(db) -> None:
    session, store, acme, _ = db
    ids = [make_batch(session, store, acme).id for _ in range(3)]
    page, more = batches.list_batches(session, acme, limit=2)
    assert [b.id for b in page] == ids[::-1][:2] and more
    rest, more = batches.list_batches(session, acme, limit=2, after=page[-1].id)
    assert [b.id for b in rest] == ids[:1] and not more
    for bad in ({"limit": 0}, {"limit": 101}, {"after": "batch_nope"}):
        with pytest.raises(batches.InvalidBatchError):
            batches.list_batches(session, acme, **bad)


def test_leases_exclude_a_second_runner_until_they_lapse(db) -> None:
    session, store, acme, _ = db
    batch = make_batch(session, store, acme)
    assert batch_runs.claim(session, batch.id, "r1", lease_s=60) is not None
    assert batch_runs.claim(session, batch.id, "r2", lease_s=60) is None
    assert batch_runs.renew(session, batch.id, "r2", 60) is None
    assert batch_runs.renew(session, batch.id, "r1", 60) == "validating"
    later = utcnow() + timedelta(seconds=61)
    assert batch_runs.claim(session, batch.id, "r2", lease_s=60, now=later) is not None  # r1 lapsed
    assert batch_runs.renew(session, batch.id, "r1", 60) is None  # r1 lost it: it must stop
    batch_runs.release(session, batch.id, "r2")
    assert batch_runs.claim(session, batch.id, "r3", lease_s=60) is not None


def test_stalled_batches_are_those_whose_runner_vanished(db) -> None:
    session, store, acme, _ = db
    batch = make_batch(session, store, acme)
    assert batch_runs.stalled_batches(session, redispatch_after_s=600) == [batch.id]  # never queued
    batch_runs.mark_dispatched(session, batch.id)
    assert batch_runs.stalled_batches(session, redispatch_after_s=600) == []  # queued just now
    batch_runs.claim(session, batch.id, "r1", lease_s=1)
    assert batch_runs.stalled_batches(session, 600, now=utcnow()) == []  # its runner holds it
    assert batch_runs.stalled_batches(session, 600, now=utcnow() + timedelta(seconds=5)) == [batch.id]


def test_a_result_is_recorded_once_and_counted_once(db) -> None:
    session, store, acme, _ = db
    batch = make_batch(session, store, acme)
    ok = batch_runs.LineResult.from_response(1, "c0", 200, {"id": "chatcmpl-1", "usage": {
        "prompt_tokens": 7, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}}})
    assert (ok.prompt_tokens, ok.cached_tokens, ok.completion_tokens, ok.request_id) == (7, 2, 5, "chatcmpl-1")
    assert batch_runs.record_result(session, batch.id, ok)
    assert not batch_runs.record_result(session, batch.id, ok)  # a second runner's copy: ignored
    bad = batch_runs.LineResult.from_response(2, "c1", 404, {"error": {"message": "no model"}})
    assert batch_runs.record_result(session, batch.id, bad)
    assert not batch_runs.record_result(session, batch.id, batch_runs.LineResult.from_response(2, "c1", 200, {}))
    session.refresh(batch)
    assert (batch.completed, batch.failed) == (1, 1)
    assert batch_runs.recorded_lines(session, batch.id) == {1, 2}
    usage = batches.batch_usage(session, [batch.id])[batch.id]
    assert usage["input_tokens"] == 7 and usage["output_tokens"] == 5 and usage["total_tokens"] == 12


def _lines(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.splitlines()]


def test_completed_batch_files_are_in_openai_format(db) -> None:
    session, store, acme, _ = db
    batch = make_batch(session, store, acme)
    batches.transition(batch, "in_progress")
    body = {"id": "chatcmpl-a", "object": "chat.completion", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    batch_runs.record_result(session, batch.id, batch_runs.LineResult.from_response(3, "c2", 200, body))
    batch_runs.record_result(session, batch.id, batch_runs.LineResult.from_response(1, "c0", 200, body))
    error = {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
    batch_runs.record_result(session, batch.id, batch_runs.LineResult.from_response(2, "c1", 400, error))
    batches.transition(batch, "finalizing")
    with pytest.raises(ValueError):
        batch_output.finalize(session, store, batch, "completed", unrun=[(9, "x")])
    batch_output.finalize(session, store, batch, "completed")
    assert batch.status == "completed" and batch.runner_id is None
    assert (batch.completed, batch.failed) == (2, 1)
    output = _lines(read_file_content(session, store, acme, batch.output_file_id))
    assert [line["custom_id"] for line in output] == ["c0", "c2"]  # input order
    assert output[0] == {"id": batch_output.request_line_id(batch.id, 1), "custom_id": "c0", "error": None,
                         "response": {"status_code": 200, "request_id": "chatcmpl-a", "body": body}}
    assert output[0]["id"].startswith("batch_req_")
    errors = _lines(read_file_content(session, store, acme, batch.error_file_id))
    assert errors == [{"id": batch_output.request_line_id(batch.id, 2), "custom_id": "c1", "error": None,
                       "response": {"status_code": 400, "request_id": None, "body": error}}]


@pytest.mark.parametrize(("how", "code"), [("expired", "batch_expired"), ("cancelled", "batch_cancelled")])
def test_expired_or_cancelled_batch_keeps_what_finished(db, how: str, code: str) -> None:
    session, store, acme, _ = db
    batch = make_batch(session, store, acme)
    batches.transition(batch, "in_progress")
    body = {"id": "chatcmpl-a", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    batch_runs.record_result(session, batch.id, batch_runs.LineResult.from_response(1, "c0", 200, body))
    if how == "cancelled":
        batches.transition(batch, "cancelling")
    batch_output.finalize(session, store, batch, how, unrun=[(2, "c1"), (3, "c2")])
    assert batch.status == how and getattr(batch, f"{how}_at") is not None
    assert (batch.total, batch.completed, batch.failed) == (3, 1, 2)
    assert [line["custom_id"] for line in _lines(read_file_content(session, store, acme, batch.output_file_id))] == ["c0"]
    errors = _lines(read_file_content(session, store, acme, batch.error_file_id))
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [("c1", None, code), ("c2", None, code)]


def test_a_batch_with_no_successes_has_no_output_file(db) -> None:
    session, store, acme, _ = db
    batch = make_batch(session, store, acme)
    batches.transition(batch, "cancelling")
    batch_output.finalize(session, store, batch, "cancelled", unrun=[(1, "c0"), (2, "c1"), (3, "c2")])
    assert batch.output_file_id is None and batch.error_file_id is not None


def test_the_gateway_reaches_celery_by_name_only() -> None:
    """gateway/ imports nothing of workers/ but its wire contract (workers.wire), nor torch; Celery
    itself loads on the first dispatch only. The Celery app of the jobs imports no torch either."""
    import subprocess
    import sys

    code = ("import sys, gateway.app, gateway.batches.api; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('workers', 'torch', 'celery') "
            "and m != 'workers' and not m.startswith('workers.wire')]; "
            "import workers.jobs.app, workers.jobs.tasks; "
            "bad += [m for m in sys.modules if m.split('.')[0] == 'torch']; sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_responses_lines_are_estimated_and_counted_in_their_own_shape() -> None:
    estimate = batches.estimate_line_tokens({"input": "hello there", "instructions": "be brief",
                                             "max_output_tokens": 7})
    assert 7 < estimate < 7 + 20
    result = batch_runs.LineResult.from_response(1, "r0", 200, {"id": "resp_1", "usage": {
        "input_tokens": 11, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 6, "total_tokens": 17}})
    assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (11, 4, 6)
