"""Batch jobs of a tenant (OpenAI's Batches API): creation, lookup, listing, cancel, the state machine.

States (OpenAI's): `validating` (queued, waiting for a runner) → `in_progress` → `finalizing` →
`completed`; `failed` (the input file is invalid: `errors` names the lines; or it was deleted
while the batch ran); `cancelling` →
`cancelled`; `expired` (not done within `completion_window`). `TRANSITIONS` is the whole graph;
`transition()` refuses anything else. Only the runner holding a batch's lease moves it past
`validating`/`in_progress`/`cancelling` (see `accounting.batch_runs`); the API only creates batches
and asks for cancellation.

Like `accounting.files`, every function works on a caller-owned `Session` (flush, never commit),
and every lookup is scoped to a tenant: another tenant's batch is `BatchNotFound`.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from accounting.batch_input import BATCH_URLS, BatchInput, BatchInputError
from accounting.files import get_file
from accounting.models import Batch, BatchResult, utcnow
from accounting.tenants import AccountingError, NotFoundError

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL = ("completed", "failed", "expired", "cancelled")
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "validating": ("in_progress", "failed", "cancelling", "expired"),
    "in_progress": ("finalizing", "cancelling", "expired", "failed"),
    "cancelling": ("cancelled",),
    "finalizing": ("completed",),
}
"""Every allowed move; terminal states have none. Files are written in the same transaction as the
move into `completed`, `expired` or `cancelled`."""
MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20
METADATA_MAX_PAIRS, METADATA_KEY_MAX, METADATA_VALUE_MAX = 16, 64, 512
DEFAULT_COMPLETION_ESTIMATE = 4096
"""Completion tokens a line is assumed to use when it sets no max_tokens (queued-token estimate)."""
PROMPT_BYTES_PER_TOKEN = 3
"""Queued-token estimate of a prompt: its JSON's UTF-8 bytes / 3 (real tokenizers average ~4 bytes
per token on English text, so this errs on the high side) plus one."""
_LINE_PREFIX = re.compile(r"line (\d+): (.*)", re.DOTALL)


class BatchNotFound(NotFoundError):
    """No batch with that id belongs to the tenant."""

    code = "batch_not_found"


class InvalidBatchError(AccountingError):
    """A batch parameter (endpoint, window, metadata, input file, cursor) is invalid."""


class BatchStateError(AccountingError):
    """The batch is in a state that does not allow this (e.g. cancelling a completed batch)."""


class QueuedTokensExceeded(AccountingError):
    """Creating the batch would take the tenant's queued batch tokens over the limit."""


def new_batch_id() -> str:
    """`batch_` and 24 random hex digits."""
    return f"batch_{secrets.token_hex(12)}"


def transition(batch: Batch, status: str, now: datetime | None = None) -> None:
    """Move `batch` to `status` and stamp `<status>_at`; `BatchStateError` if the graph forbids it."""
    if status not in TRANSITIONS.get(batch.status, ()):
        raise BatchStateError(f"a batch cannot go from {batch.status!r} to {status!r}")
    batch.status = status
    setattr(batch, f"{status}_at", now or utcnow())


def check_metadata(metadata: object) -> dict[str, str] | None:
    """OpenAI's metadata rules: at most 16 string pairs, keys ≤ 64 and values ≤ 512 characters."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise InvalidBatchError("metadata must be an object of string keys and values")
    if len(metadata) > METADATA_MAX_PAIRS:
        raise InvalidBatchError(f"metadata holds at most {METADATA_MAX_PAIRS} pairs")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > METADATA_KEY_MAX or len(value) > METADATA_VALUE_MAX:
            raise InvalidBatchError(f"metadata keys are strings of at most {METADATA_KEY_MAX} characters and "
                                    f"values strings of at most {METADATA_VALUE_MAX}")
    return dict(metadata)


def estimate_line_tokens(body: dict[str, Any]) -> int:
    """Queued-token estimate of one line: prompt estimate + (max_tokens or 4096) × n."""
    prompt = body.get("messages", body.get("prompt", [body.get("instructions", ""), body.get("input", "")]))
    prompt_estimate = len(json.dumps(prompt, ensure_ascii=False).encode()) // PROMPT_BYTES_PER_TOKEN + 1
    completion = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
    if isinstance(completion, bool) or not isinstance(completion, int) or completion < 0:  # 0: echo, prompt alone
        completion = DEFAULT_COMPLETION_ESTIMATE
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        n = 1
    return prompt_estimate + completion * n


def estimate_tokens(parsed: BatchInput) -> int:
    return sum(estimate_line_tokens(request.body) for request in parsed.requests)


def queued_tokens(session: Session, tenant_id: int) -> int:
    """The estimates of the tenant's unfinished batches, summed (a batch counts fully until it ends)."""
    total = session.scalar(select(func.coalesce(func.sum(Batch.estimated_tokens), 0))
                           .where(Batch.tenant_id == tenant_id, Batch.status.in_(UNFINISHED)))
    return int(total or 0)


def input_problems(parsed: BatchInput | BatchInputError, endpoint: str) -> list[dict[str, Any]]:
    """OpenAI `errors.data` entries for an invalid input file (empty when it fits the batch)."""
    if isinstance(parsed, BatchInputError):
        data = []
        for problem in parsed.problems:
            match = _LINE_PREFIX.fullmatch(problem)
            data.append({"code": "invalid_input_line" if match else "invalid_input_file",
                         "message": problem, "param": None, "line": int(match[1]) if match else None})
        if parsed.total > len(parsed.problems):
            data.append({"code": "invalid_input_file", "param": None, "line": None,
                         "message": f"and {parsed.total - len(parsed.problems)} more problems"})
        return data
    if parsed.endpoint != endpoint:
        first = parsed.requests[0].line
        return [{"code": "mismatched_endpoint", "param": "endpoint", "line": first,
                 "message": f"line {first}: url {parsed.endpoint} does not match the batch's endpoint {endpoint}"}]
    return []


def create_batch(session: Session, *, tenant_id: int, key_id: int | None, input_file_id: str, endpoint: str,
                 completion_window: str, metadata: object, parsed: BatchInput | BatchInputError,
                 max_queued_tokens: int) -> Batch:
    """A new batch: `validating` (to be run) or, when its input is invalid, `failed` with `errors`.

    `parsed` is the input file checked by `validate_batch_input` (or its error). `max_queued_tokens`
    (0 = unlimited) caps the estimates of the tenant's unfinished batches, this one included:
    beyond it `QueuedTokensExceeded`, and nothing is created.
    """
    if endpoint not in BATCH_URLS:
        raise InvalidBatchError(f"endpoint must be {' or '.join(BATCH_URLS)}, got {endpoint!r}")
    if completion_window not in COMPLETION_WINDOWS:
        raise InvalidBatchError(f"completion_window must be {', '.join(COMPLETION_WINDOWS)}, got {completion_window!r}")
    metadata = check_metadata(metadata)
    source = get_file(session, tenant_id, input_file_id)
    if source.purpose != "batch":
        raise InvalidBatchError(f"file {input_file_id!r} has purpose {source.purpose!r}; a batch input needs 'batch'")
    now = utcnow()
    batch = Batch(id=new_batch_id(), tenant_id=tenant_id, key_id=key_id, endpoint=endpoint,
                  input_file_id=input_file_id, completion_window=completion_window, metadata_json=metadata,
                  created_at=now, expires_at=now + COMPLETION_WINDOWS[completion_window], status="validating")
    problems = input_problems(parsed, endpoint)
    if problems:
        batch.errors_json = problems
        transition(batch, "failed", now)
    else:
        assert isinstance(parsed, BatchInput)
        batch.total = len(parsed.requests)
        batch.estimated_tokens = estimate_tokens(parsed)
        if max_queued_tokens:
            queued = queued_tokens(session, tenant_id)
            if queued + batch.estimated_tokens > max_queued_tokens:
                raise QueuedTokensExceeded(
                    f"this batch needs an estimated {batch.estimated_tokens} tokens, and this tenant's "
                    f"unfinished batches already hold {queued} of its {max_queued_tokens} queued batch tokens; "
                    f"wait for them to finish or cancel one")
    session.add(batch)
    session.flush()
    return batch


def get_batch(session: Session, tenant_id: int, batch_id: str) -> Batch:
    """The tenant's batch `batch_id`, else `BatchNotFound`."""
    row = session.scalar(select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id))
    if row is None:
        raise BatchNotFound(f"no such batch: {batch_id!r}")
    return row


def list_batches(session: Session, tenant_id: int, limit: int = DEFAULT_LIST_LIMIT,
                 after: str | None = None) -> tuple[list[Batch], bool]:
    """(up to `limit` of the tenant's batches, newest first, whether more follow); `after` = the last id seen."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidBatchError(f"limit must be between 1 and {MAX_LIST_LIMIT}")
    query = select(Batch).where(Batch.tenant_id == tenant_id)
    if after is not None:
        try:
            cursor = get_batch(session, tenant_id, after)
        except BatchNotFound as exc:
            raise InvalidBatchError(f"unknown 'after' cursor {after!r}") from exc
        # (created_at, id) is a total order: ties on created_at are broken by id.
        query = query.where(or_(Batch.created_at < cursor.created_at,
                                and_(Batch.created_at == cursor.created_at, Batch.id < cursor.id)))
    rows = list(session.scalars(query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def cancel_batch(session: Session, tenant_id: int, batch_id: str) -> Batch:
    """Ask for cancellation: `cancelling` (the runner stops starting lines and ends it `cancelled`).

    Cancelling a batch that is already cancelling or cancelled returns it unchanged; a batch that
    is finalizing or has ended cannot be cancelled (`BatchStateError`).
    """
    batch = get_batch(session, tenant_id, batch_id)
    if batch.status in ("cancelling", "cancelled"):
        return batch
    if "cancelling" not in TRANSITIONS.get(batch.status, ()):
        raise BatchStateError(f"batch {batch_id!r} is {batch.status} and cannot be cancelled")
    transition(batch, "cancelling")
    session.flush()
    return batch


def batch_usage(session: Session, batch_ids: list[str]) -> dict[str, dict[str, Any]]:
    """OpenAI's `usage` object of each batch, from its recorded results."""
    rows = session.execute(
        select(BatchResult.batch_id, func.sum(BatchResult.prompt_tokens), func.sum(BatchResult.cached_tokens),
               func.sum(BatchResult.completion_tokens))
        .where(BatchResult.batch_id.in_(batch_ids)).group_by(BatchResult.batch_id))
    found = {batch_id: (int(p or 0), int(c or 0), int(o or 0)) for batch_id, p, c, o in rows}
    out = {}
    for batch_id in batch_ids:
        prompt, cached, completion = found.get(batch_id, (0, 0, 0))
        out[batch_id] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                         "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": prompt + completion}
    return out


def _unix(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def batch_to_dict(batch: Batch, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """The OpenAI Batch object."""
    errors = None
    if batch.errors_json:
        errors = {"object": "list", "data": batch.errors_json}
    body: dict[str, Any] = {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint, "errors": errors,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": batch.status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": _unix(batch.created_at), "in_progress_at": _unix(batch.in_progress_at),
        "expires_at": _unix(batch.expires_at), "finalizing_at": _unix(batch.finalizing_at),
        "completed_at": _unix(batch.completed_at), "failed_at": _unix(batch.failed_at),
        "expired_at": _unix(batch.expired_at), "cancelling_at": _unix(batch.cancelling_at),
        "cancelled_at": _unix(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "metadata": batch.metadata_json,
    }
    if usage is not None:
        body["usage"] = usage
    return body
