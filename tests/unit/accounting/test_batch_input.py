"""Validation of batch input files: every rule, with the line numbers an editor would show. Every case
runs both ways, in memory (`validate_batch_input`) and from a file on disk read line by line
(`check_batch_input_file`, what an upload uses), and both must agree."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from accounting.batch_input import (
    MAX_REPORTED_PROBLEMS,
    BatchInputCheck,
    BatchInputError,
    check_batch_input_file,
    validate_batch_input,
)

CHAT = "/v1/chat/completions"


def line(custom_id: str = "r1", *, url: str = CHAT, method: str = "POST", body: Any = None, **extra: Any) -> str:
    item = {"custom_id": custom_id, "method": method, "url": url,
            "body": {"model": "m", "messages": []} if body is None else body, **extra}
    return json.dumps(item)


def on_disk(data: bytes, max_line_bytes: int = 10**9, **limits: int) -> BatchInputCheck | BatchInputError:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "in.jsonl"
        path.write_bytes(data)
        try:
            return check_batch_input_file(path, max_line_bytes=max_line_bytes, **limits)
        except BatchInputError as error:
            return error


def validate(text: str | bytes, *, max_lines: int = 100, max_bytes: int = 10_000):
    data = text.encode() if isinstance(text, str) else text
    from_disk = on_disk(data, max_lines=max_lines, max_bytes=max_bytes)
    try:
        parsed = validate_batch_input(data, max_lines=max_lines, max_bytes=max_bytes)
    except BatchInputError as error:
        assert isinstance(from_disk, BatchInputError), from_disk
        assert (from_disk.problems, from_disk.total) == (error.problems, error.total)
        raise
    assert from_disk == BatchInputCheck(parsed.endpoint, len(parsed.requests))
    return parsed


def problems(text: str | bytes, **limits: int) -> list[str]:
    with pytest.raises(BatchInputError) as info:
        validate(text, **limits)
    return info.value.problems


def test_a_valid_file_is_parsed() -> None:
    parsed = validate(line("a") + "\n" + line("b", body={"model": "m", "messages": [{"role": "user"}]}) + "\n")
    assert parsed.endpoint == CHAT
    assert [(r.line, r.custom_id) for r in parsed.requests] == [(1, "a"), (2, "b")]
    assert parsed.requests[1].body["messages"] == [{"role": "user"}]
    completions = validate(line("x", url="/v1/completions", body={"model": "m", "prompt": "hi"}))
    assert completions.endpoint == "/v1/completions"


def test_blank_lines_are_skipped_but_counted() -> None:
    parsed = validate("\n" + line("a") + "\r\n\n  \n" + line("b") + "\n\n")
    assert [(r.line, r.custom_id) for r in parsed.requests] == [(2, "a"), (5, "b")]
    assert problems("\n\n" + line("a") + "\n\n{oops\n") == ["line 5: not valid JSON"]


def test_malformed_json_and_non_objects() -> None:
    text = "\n".join([line("a"), "{not json", line("b"), "[1, 2]", '"str"'])
    assert problems(text) == ["line 2: not valid JSON", "line 4: must be a JSON object",
                              "line 5: must be a JSON object"]


def test_utf8_is_required() -> None:
    assert problems(line("a").encode() + b"\n" + b'{"custom_id": "\xff"}') == ["line 2: not valid UTF-8"]
    assert validate(line("caf\u00e9")).requests[0].custom_id == "caf\u00e9"


def test_duplicate_custom_id_names_the_first_line() -> None:
    text = "\n".join([line("x"), line("y"), line("z"), line("y"), line("x")])
    assert problems(text) == ["line 4: duplicate custom_id 'y' (first on line 2)",
                              "line 5: duplicate custom_id 'x' (first on line 1)"]


def test_custom_id_must_be_a_non_empty_string() -> None:
    text = "\n".join([line(""), json.dumps({"method": "POST", "url": CHAT, "body": {"model": "m"}}),
                      line("ok"), line(3)])  # type: ignore[arg-type]
    assert problems(text) == [f"line {n}: custom_id must be a non-empty string" for n in (1, 2, 4)]


def test_url_and_method() -> None:
    text = "\n".join([line("a", url="/v1/embeddings"), line("b", method="GET"), line("c", url=CHAT)])
    assert problems(text) == ["line 1: url must be /v1/chat/completions or /v1/completions or /v1/responses",
                              "line 2: method must be POST"]


def test_one_url_per_file() -> None:
    text = "\n".join([line("a"), line("b"), line("c", url="/v1/completions"), line("d")])
    assert problems(text) == ["line 3: all lines must use the same url (line 1 uses /v1/chat/completions)"]


def test_body_must_be_an_object_with_a_model() -> None:
    text = "\n".join([line("a", body=[1]), line("b", body={"messages": []}), line("c", body={"model": ""}),
                      line("d", body={"model": 7}), json.dumps({"custom_id": "e", "method": "POST", "url": CHAT}),
                      line("f")])
    assert problems(text) == [f"line {n}: body must be an object with a 'model'" for n in range(1, 6)]


def test_several_problems_on_one_line_are_all_named() -> None:
    assert problems(json.dumps({"custom_id": 1, "method": "PUT", "url": "/x", "body": None})) == [
        "line 1: custom_id must be a non-empty string", "line 1: method must be POST",
        "line 1: url must be /v1/chat/completions or /v1/completions or /v1/responses",
        "line 1: body must be an object with a 'model'"]


def test_empty_files_are_refused() -> None:
    for text in ("", "\n", "  \n\n \r\n"):
        assert problems(text) == ["file is empty: it has no requests"]


def test_limits() -> None:
    text = "\n".join(line(f"r{i}") for i in range(5)) + "\n\n\n"
    assert len(validate(text, max_lines=5).requests) == 5  # blank lines do not count
    assert problems(text, max_lines=4) == ["too many lines: 5 requests (at most 4)"]
    size = len(text.encode())
    assert len(validate(text, max_bytes=size).requests) == 5
    assert problems(text, max_bytes=size - 1) == [f"file is too large: {size} bytes (at most {size - 1})"]


def test_only_the_first_problems_are_listed() -> None:
    text = "\n".join(["{bad"] * 25)
    with pytest.raises(BatchInputError) as info:
        validate(text)
    error = info.value
    assert len(error.problems) == MAX_REPORTED_PROBLEMS and error.total == 25
    assert error.problems[0] == "line 1: not valid JSON" and error.problems[-1] == "line 10: not valid JSON"
    assert str(error).endswith("line 10: not valid JSON (and 15 more problems)")
    assert "line 11" not in str(error)


def test_extra_fields_are_ignored() -> None:
    assert validate(line("a", note="hello")).requests[0].custom_id == "a"


def test_on_disk_a_line_longer_than_a_request_body_is_a_problem_of_its_own() -> None:
    long, other = (line(name, body={"model": "m", "prompt": "x" * 500}) for name in ("lng1", "lng2"))
    text = "\n".join([line("a"), long, line("b"), other + "   "]).encode()
    error = on_disk(text, max_line_bytes=len(long) + 1, max_lines=10, max_bytes=10_000)  # the 2nd fits, newline and all
    assert isinstance(error, BatchInputError)
    assert error.problems == ["line 4: longer than the largest request body the gateway accepts"]
    assert on_disk(text[:-3], max_line_bytes=len(long), max_lines=10, max_bytes=10_000) == BatchInputCheck(CHAT, 4)
