"""A batch's output and error files (OpenAI's line format), written when the batch ends.

Output file: one line per line that succeeded (HTTP 200), in input order:
`{"id": "batch_req_…", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`.
Error file: every other line: a non-200 answer keeps its `response` (the error body), a line that
never ran (the batch expired or was cancelled first) has `"response": null` and
`"error": {"code": "batch_expired" | "batch_cancelled", "message"}`. So when a batch has ended,
each `custom_id` of the input is in exactly one of the two files, once, and
`request_counts.completed` / `failed` count their lines.

The files, their metadata rows, the given-up lines and the move into the terminal state commit in
one transaction (the caller's), so a crash leaves the batch unfinished, to be finalized again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session

from accounting import batch_runs
from accounting.batches import transition
from accounting.file_store import FileStore
from accounting.files import create_file
from accounting.models import Batch, BatchResult

GIVEN_UP = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}
"""Terminal state → (code, message) of the lines that had not run."""


def request_line_id(batch_id: str, line: int) -> str:
    """The line's stable `batch_req_…` id (the same every time the files are written)."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:24]


def output_line(batch_id: str, result: BatchResult) -> dict[str, Any]:
    """One line of the output or error file."""
    response = None
    error = None
    if result.status_code is not None:
        response = {"status_code": result.status_code, "request_id": result.request_id, "body": result.body}
    else:
        error = {"code": result.error_code, "message": result.error_message}
    return {"id": request_line_id(batch_id, result.line), "custom_id": result.custom_id,
            "response": response, "error": error}


def render(batch_id: str, results: Iterable[BatchResult]) -> tuple[bytes, bytes]:
    """(output file bytes, error file bytes) of the results, each in input line order."""
    output: list[bytes] = []
    errors: list[bytes] = []
    for result in sorted(results, key=lambda r: r.line):
        encoded = json.dumps(output_line(batch_id, result), ensure_ascii=False, separators=(",", ":")).encode()
        (output if result.status_code == 200 else errors).append(encoded + b"\n")
    return b"".join(output), b"".join(errors)


def finalize(session: Session, store: FileStore, batch: Batch, terminal: str,
             unrun: Iterable[tuple[int, str]] = (), written: list[str] | None = None) -> None:
    """End `batch` as `terminal` (completed, expired, cancelled; failed) with its output and error files.

    `unrun` are the (line, custom_id) never run: they are recorded as given up (expired/cancelled
    only; a completed batch has none). The storage keys of the files written are appended to
    `written`, so the caller can delete them if its transaction then fails.
    """
    if terminal in GIVEN_UP:
        code, message = GIVEN_UP[terminal]
        for line, custom_id in unrun:
            batch_runs.record_result(session, batch.id, batch_runs.LineResult.given_up(line, custom_id, code, message))
    elif list(unrun):
        raise ValueError(f"a {terminal} batch gives up no lines")
    session.flush()
    session.refresh(batch)  # the counters were bumped in SQL
    output, errors = render(batch.id, batch_runs.results(session, batch.id))
    for data, purpose, suffix, field in ((output, "batch_output", "output", "output_file_id"),
                                         (errors, "batch_errors", "error", "error_file_id")):
        if data:
            row = create_file(session, store, batch.tenant_id, f"{batch.id}_{suffix}.jsonl", purpose, data)
            if written is not None:
                written.append(row.storage_key)
            setattr(batch, field, row.id)
    transition(batch, terminal)
    batch.runner_id, batch.lease_until = None, None
    session.flush()
