"""The usage record of one served request: one row of usage_events, checked when it is made.

A `UsageRecord` has exactly the columns of `accounting.models.UsageEvent` except the surrogate `id`.
It is checked when it is made (tz-aware times, non-negative token counts, strings that fit their
columns), so a bad record fails in the caller, not later in the writer's batch or in its spool.
`to_json`/`from_json` are the line format of the usage writer's spool (`accounting.usage_spool`),
the local file where `accounting.usage_writer` keeps rows while the database is unavailable;
`to_copy_line` is a line of the COPY that `accounting.usage_commit.insert_records` sends PostgreSQL.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from accounting.models import UsageEvent

TIME_FIELDS = ("started_at", "finished_at")
"""The datetime fields (timezone-aware, UTC)."""
_TOKEN_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens")
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
_COPY_SPECIAL = re.compile(r"[\\\t\n\r]")  # a search costs far less than a translate


def _max_lengths() -> dict[str, int]:
    """Column name → maximum length of the String columns of usage_events."""
    lengths: dict[str, int] = {}
    for column in UsageEvent.__table__.columns:
        length = getattr(column.type, "length", None)
        if isinstance(length, int):
            lengths[column.name] = length
    return lengths


_MAX_LENGTHS = _max_lengths()


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageRecord:
    """One request's usage; `request_id` is unique in the table (one row per request).

    Times must be timezone-aware; they are normalised to UTC. Immutable, so it can be handed to the
    writer thread without copying.
    """

    request_id: str
    tenant_id: int
    key_id: int | None = None
    model: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    status: str
    """ok | client_disconnected | upstream_error | gateway_lost | rejected."""
    finish_reason: str | None = None
    ttft_ms: float | None = None
    latency_ms: float | None = None
    started_at: datetime
    finished_at: datetime
    batch_id: str | None = None
    route: str | None = None
    """The API route that served it: chat.completions | completions | responses (None on rows from
    before the column existed)."""

    def __post_init__(self) -> None:
        for name in TIME_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, datetime) or value.tzinfo is None:
                raise ValueError(f"{name} must be a timezone-aware datetime, got {value!r}")
            object.__setattr__(self, name, value.astimezone(UTC))
        for name in _TOKEN_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        for name, length in _MAX_LENGTHS.items():
            value = getattr(self, name)
            if value is not None and (len(value) > length or "\x00" in value):
                raise ValueError(f"{name} is longer than {length} characters or holds a NUL")

    def to_row(self) -> dict[str, Any]:
        """The row to insert: column name → value (times as tz-aware datetimes)."""
        return {name: getattr(self, name) for name in FIELD_NAMES}

    def to_json(self) -> str:
        """One spool line (without the newline): a JSON object, times in ISO 8601 with offset."""
        row = self.to_row()
        for name in TIME_FIELDS:
            row[name] = row[name].isoformat()
        return json.dumps(row, separators=(",", ":"))

    def to_copy_line(self) -> str:
        """The row as a line of PostgreSQL's COPY text format (columns in FIELD_NAMES order)."""
        cells = []
        for name in FIELD_NAMES:
            value = getattr(self, name)
            if value is None:
                cells.append("\\N")
            elif isinstance(value, str):
                cells.append(value.translate(_COPY_ESCAPES) if _COPY_SPECIAL.search(value) else value)
            elif isinstance(value, datetime):
                cells.append(value.isoformat())
            else:
                cells.append(str(value))
        return "\t".join(cells) + "\n"

    @classmethod
    def from_json(cls, line: str | bytes) -> UsageRecord:
        """The record of a `to_json` line; raises ValueError (or TypeError) on a malformed one."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("a usage spool line must be a JSON object")
        for name in TIME_FIELDS:
            if isinstance(data.get(name), str):
                data[name] = datetime.fromisoformat(data[name])
        return cls(**data)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(UsageRecord))
"""The record's fields, in order: the columns of usage_events except `id`."""
