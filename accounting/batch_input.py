"""Validation of batch input files (JSONL), before they are accepted as uploads.

Each non-blank line is one request:
`{"custom_id": str, "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}`
and every line of a file uses the same url. Blank lines are skipped (a trailing newline is normal);
line numbers in messages count every physical line from 1, blank ones included, so they match an
editor's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from accounting.tenants import AccountingError

BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
MAX_REPORTED_PROBLEMS = 10
"""At most this many problems are kept and reported; the rest are only counted."""


class BatchInputError(AccountingError):
    """The file is not a valid batch input: `problems` are the first problems, `total` counts all."""

    def __init__(self, problems: list[str], total: int | None = None) -> None:
        self.problems = problems
        self.total = len(problems) if total is None else total
        message = "invalid batch input file: " + "; ".join(problems)
        if self.total > len(problems):
            message += f" (and {self.total - len(problems)} more problems)"
        super().__init__(message)


@dataclass(frozen=True)
class BatchRequest:
    """One valid line of a batch input file."""

    line: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BatchInput:
    """A validated batch input file: its endpoint (the url of every line) and its requests."""

    endpoint: str
    requests: list[BatchRequest] = field(default_factory=list)


class _Problems:
    """Collects problems: keeps the first `MAX_REPORTED_PROBLEMS`, counts the rest."""

    def __init__(self) -> None:
        self.kept: list[str] = []
        self.total = 0

    def add(self, message: str) -> None:
        self.total += 1
        if len(self.kept) < MAX_REPORTED_PROBLEMS:
            self.kept.append(message)


def _check_line(number: int, raw: bytes, problems: _Problems) -> dict[str, Any] | None:
    """The line's object if its syntax and fields are valid (url consistency is checked by the caller)."""
    try:
        item = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        problems.add(f"line {number}: not valid UTF-8")
        return None
    except json.JSONDecodeError:
        problems.add(f"line {number}: not valid JSON")
        return None
    if not isinstance(item, dict):
        problems.add(f"line {number}: must be a JSON object")
        return None
    ok = True
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        problems.add(f"line {number}: custom_id must be a non-empty string")
        ok = False
    if item.get("method") != "POST":
        problems.add(f"line {number}: method must be POST")
        ok = False
    if item.get("url") not in BATCH_URLS:
        problems.add(f"line {number}: url must be {' or '.join(BATCH_URLS)}")
        ok = False
    body = item.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        problems.add(f"line {number}: body must be an object with a 'model'")
        ok = False
    return item if ok else None


def validate_batch_input(data: bytes, *, max_lines: int, max_bytes: int) -> BatchInput:
    """The parsed requests of a batch input file, or `BatchInputError` listing its problems.

    Size and line-count limits are checked first and alone (nothing else is parsed when they fail).
    """
    if len(data) > max_bytes:
        raise BatchInputError([f"file is too large: {len(data)} bytes (at most {max_bytes})"])
    lines = [(number, raw) for number, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]
    if not lines:
        raise BatchInputError(["file is empty: it has no requests"])
    if len(lines) > max_lines:
        raise BatchInputError([f"too many lines: {len(lines)} requests (at most {max_lines})"])

    problems = _Problems()
    requests: list[BatchRequest] = []
    first_line: dict[str, int] = {}  # custom_id -> line it first appeared on
    endpoint: tuple[str, int] | None = None  # (url, line) of the first line with a valid url
    for number, raw in lines:
        item = _check_line(number, raw, problems)
        if item is None:
            continue
        url, custom_id = item["url"], item["custom_id"]
        if endpoint is None:
            endpoint = (url, number)
        elif url != endpoint[0]:
            problems.add(f"line {number}: all lines must use the same url (line {endpoint[1]} uses {endpoint[0]})")
            continue
        if custom_id in first_line:
            problems.add(f"line {number}: duplicate custom_id {custom_id!r} (first on line {first_line[custom_id]})")
            continue
        first_line[custom_id] = number
        requests.append(BatchRequest(line=number, custom_id=custom_id, body=item["body"]))
    if problems.total or endpoint is None:
        raise BatchInputError(problems.kept, problems.total)
    return BatchInput(endpoint=endpoint[0], requests=requests)
