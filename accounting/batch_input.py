"""Validation of batch input files (JSONL), before they are accepted as uploads.

Each non-blank line is one request:
`{"custom_id": str, "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" | "/v1/responses", "body": {...}}`
and every line of a file uses the same url. Blank lines are skipped (a trailing newline is normal);
line numbers in messages count every physical line from 1, blank ones included, so they match an
editor's.

Two entry points apply the same rules: `validate_batch_input` parses bytes in memory and returns
every request (a batch's creation and its runner need them), `check_batch_input_file` reads an
uploaded file from disk line by line and keeps only what the rules need (the custom_ids), so an
upload of up to TOLLWAY_MAX_FILE_BYTES is never held in memory; it also bounds each line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from accounting.tenants import AccountingError

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
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


@dataclass(frozen=True)
class BatchInputCheck:
    """A batch input file found valid on disk: its endpoint and how many requests it holds."""

    endpoint: str
    requests: int


def _check_size_and_count(size: int, count: int, *, max_lines: int, max_bytes: int) -> None:
    """The limits, checked first and alone (nothing else is parsed when they fail)."""
    if size > max_bytes:
        raise BatchInputError([f"file is too large: {size} bytes (at most {max_bytes})"])
    if not count:
        raise BatchInputError(["file is empty: it has no requests"])
    if count > max_lines:
        raise BatchInputError([f"too many lines: {count} requests (at most {max_lines})"])


def _check_lines(lines: Iterable[tuple[int, bytes | None]], keep: list[BatchRequest] | None) -> str:
    """Every rule over the numbered non-blank lines (None: a line over the length limit); the
    endpoint, or `BatchInputError`. Valid requests are appended to `keep` when it is given."""
    problems = _Problems()
    first_line: dict[str, int] = {}  # custom_id -> line it first appeared on
    endpoint: tuple[str, int] | None = None  # (url, line) of the first line with a valid url
    for number, raw in lines:
        if raw is None:
            problems.add(f"line {number}: longer than the largest request body the gateway accepts")
            continue
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
        if keep is not None:
            keep.append(BatchRequest(line=number, custom_id=custom_id, body=item["body"]))
    if problems.total or endpoint is None:
        raise BatchInputError(problems.kept, problems.total)
    return endpoint[0]


def validate_batch_input(data: bytes, *, max_lines: int, max_bytes: int) -> BatchInput:
    """The parsed requests of a batch input file, or `BatchInputError` listing its problems."""
    lines = [(number, raw) for number, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]
    _check_size_and_count(len(data), len(lines), max_lines=max_lines, max_bytes=max_bytes)
    requests: list[BatchRequest] = []
    endpoint = _check_lines(lines, requests)
    return BatchInput(endpoint=endpoint, requests=requests)


_SKIP_CHUNK = 2**20


def _file_lines(handle: IO[bytes], max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(number, line without its newline) of every non-blank line, read one at a time; a line over
    `max_line_bytes` is (number, None), skipped without being held in memory."""
    number = 0
    while raw := handle.readline(max_line_bytes + 1):
        number += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):  # over the limit: skip to its end
            while raw and not raw.endswith(b"\n"):
                raw = handle.readline(_SKIP_CHUNK)
            yield number, None
        elif raw.strip():
            yield number, raw.removesuffix(b"\n")


def check_batch_input_file(path: Path, *, max_lines: int, max_bytes: int,
                           max_line_bytes: int) -> BatchInputCheck:
    """`validate_batch_input`'s rules over a file on disk, read line by line (two passes: the
    limits, then the lines), keeping no request; plus: no line longer than `max_line_bytes`."""
    with path.open("rb") as handle:
        count = sum(1 for _ in _file_lines(handle, max_line_bytes))
        _check_size_and_count(path.stat().st_size, count, max_lines=max_lines, max_bytes=max_bytes)
        handle.seek(0)
        endpoint = _check_lines(_file_lines(handle, max_line_bytes), None)
    return BatchInputCheck(endpoint=endpoint, requests=count)
