"""What a batch runner does in SQL: hold a lease on a batch, record line results exactly once.

Invariants:
- At most one runner moves a batch on at a time: `claim` takes the lease only when it is free,
  expired or already the caller's; `renew` extends it only for its holder. A runner that lost its
  lease (it stalled past `lease_until` and another took over) stops.
- A line has at most one result: `record_result` inserts with ON CONFLICT DO NOTHING on
  UNIQUE(batch_id, line) and bumps `completed`/`failed` only when the row was new, in the same
  transaction, so the counters always equal the recorded results.

Functions work on a caller-owned `Session` (flush, never commit), like the rest of `accounting`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Table, and_, insert, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from accounting.batches import UNFINISHED
from accounting.models import Batch, BatchResult, utcnow

_RESULTS = cast(Table, BatchResult.__table__)


@dataclass(frozen=True)
class LineResult:
    """The outcome of one input line: an HTTP answer (`status_code`, `body`) or an `error_code`."""

    line: int
    custom_id: str
    status_code: int | None = None
    body: dict[str, Any] | None = None
    request_id: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    @property
    def succeeded(self) -> bool:
        return self.status_code == 200

    @classmethod
    def from_response(cls, line: int, custom_id: str, status_code: int, body: dict[str, Any]) -> LineResult:
        """From the gateway's answer; usage (when there is one) gives the tokens, in the chat /
        completions shape (`prompt_tokens`, ...) or the Responses one (`input_tokens`, ...)."""
        usage = body.get("usage") if status_code == 200 else None
        usage = usage if isinstance(usage, dict) else {}
        responses = "input_tokens" in usage
        details = usage.get("input_tokens_details" if responses else "prompt_tokens_details") or {}
        return cls(line=line, custom_id=custom_id, status_code=status_code, body=body,
                   request_id=body.get("id") if isinstance(body.get("id"), str) else None,
                   prompt_tokens=int(usage.get("input_tokens" if responses else "prompt_tokens", 0)),
                   cached_tokens=int(details.get("cached_tokens", 0)),
                   completion_tokens=int(usage.get("output_tokens" if responses else "completion_tokens", 0)))

    @classmethod
    def given_up(cls, line: int, custom_id: str, code: str, message: str) -> LineResult:
        """A line that never got an answer (the batch expired or was cancelled first)."""
        return cls(line=line, custom_id=custom_id, error_code=code, error_message=message)


def claim(session: Session, batch_id: str, runner_id: str, lease_s: float, now: datetime | None = None) -> Batch | None:
    """Take (or extend) the lease on an unfinished batch; None when another runner holds it or it has ended."""
    now = now or utcnow()
    result = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_(UNFINISHED),
               or_(Batch.lease_until.is_(None), Batch.lease_until < now, Batch.runner_id == runner_id))
        .values(runner_id=runner_id, lease_until=now + timedelta(seconds=lease_s))
        .execution_options(synchronize_session=False))
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return None
    batch = session.get(Batch, batch_id, populate_existing=True)
    return batch


def renew(session: Session, batch_id: str, runner_id: str, lease_s: float) -> str | None:
    """Extend the caller's lease; the batch's status, or None when the caller no longer holds it."""
    now = utcnow()
    result = session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.runner_id == runner_id)
        .values(lease_until=now + timedelta(seconds=lease_s)).execution_options(synchronize_session=False))
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return None
    return session.scalar(select(Batch.status).where(Batch.id == batch_id))


def release(session: Session, batch_id: str, runner_id: str) -> None:
    """Give the lease back (so a continuation, or any runner, can claim it at once)."""
    session.execute(update(Batch).where(Batch.id == batch_id, Batch.runner_id == runner_id)
                    .values(runner_id=None, lease_until=None).execution_options(synchronize_session=False))


def recorded_lines(session: Session, batch_id: str) -> set[int]:
    """Lines of the batch that already have a result (they are never run again)."""
    return set(session.scalars(select(BatchResult.line).where(BatchResult.batch_id == batch_id)))


def _insert_ignoring_duplicates(session: Session, row: dict[str, Any]) -> bool:
    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        statement: Any = sqlite.insert(_RESULTS).on_conflict_do_nothing(index_elements=["batch_id", "line"])
    elif dialect == "postgresql":
        statement = postgresql.insert(_RESULTS).on_conflict_do_nothing(index_elements=["batch_id", "line"])
    else:  # no portable upsert: look first (the unique constraint still guards against a race)
        if session.scalar(select(BatchResult.id).where(BatchResult.batch_id == row["batch_id"],
                                                       BatchResult.line == row["line"])) is not None:
            return False
        statement = insert(_RESULTS)
    return session.execute(statement, row).rowcount == 1  # type: ignore[attr-defined]


def record_result(session: Session, batch_id: str, result: LineResult) -> bool:
    """Record `result` unless its line has one already; True when it was new (and counted)."""
    row = {"batch_id": batch_id, "line": result.line, "custom_id": result.custom_id,
           "request_id": result.request_id, "status_code": result.status_code, "body": result.body,
           "error_code": result.error_code, "error_message": result.error_message,
           "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
           "completion_tokens": result.completion_tokens, "created_at": utcnow()}
    if not _insert_ignoring_duplicates(session, row):
        return False
    counter = Batch.completed if result.succeeded else Batch.failed
    session.execute(update(Batch).where(Batch.id == batch_id).values({counter: counter + 1})
                    .execution_options(synchronize_session=False))
    return True


def results(session: Session, batch_id: str) -> list[BatchResult]:
    """Every recorded result of the batch, in input line order."""
    return list(session.scalars(select(BatchResult).where(BatchResult.batch_id == batch_id)
                                .order_by(BatchResult.line)))


def stalled_batches(session: Session, redispatch_after_s: float, now: datetime | None = None) -> list[str]:
    """Unfinished batches no live runner holds, whose last queued run task is presumed lost: to queue again.

    Lost: the lease lapsed after the last dispatch (its runner died, e.g. a killed worker), or the
    last dispatch is older than `redispatch_after_s` (a message lost with a broker, or still queued
    behind long batches: a duplicate run task is harmless, it finds the lease taken or the batch done).
    """
    now = now or utcnow()
    stale = now - timedelta(seconds=redispatch_after_s)
    free = or_(Batch.lease_until.is_(None), Batch.lease_until < now)
    lost = or_(Batch.dispatched_at.is_(None), Batch.dispatched_at < stale,
               and_(Batch.lease_until.is_not(None), Batch.dispatched_at < Batch.lease_until))
    return list(session.scalars(select(Batch.id).where(Batch.status.in_(UNFINISHED), free, lost)
                                .order_by(Batch.created_at)))


def mark_dispatched(session: Session, batch_id: str) -> None:
    session.execute(update(Batch).where(Batch.id == batch_id).values(dispatched_at=utcnow())
                    .execution_options(synchronize_session=False))
