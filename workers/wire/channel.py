"""Frames of the generate channel (`GET /internal/channel`): many generate requests multiplexed on
one websocket per gateway process and worker.

Frames are binary websocket messages holding one JSON object (orjson). The caller numbers its
requests (`id`, unique on its channel):

    caller -> worker  GenerateFrame  {"op": "generate", "id": N, "body": <GenerateRequest JSON>,
                                      "headers": {"traceparent": ...}}
                      CancelFrame    {"op": "cancel", "id": N}
                      AckFrame       {"op": "ack", "request_ids": [...]}   these requests' usage rows
                                      are committed: the worker may forget their usage
    worker -> caller  LinesFrame     {"id": N, "lines": [<result line>, ...]}   in order; the line
                                      carrying `usage` ends N
                      ErrorFrame     {"id": N, "error": {"status": 400, "message": ...}}  N refused

`cancel` is the same verb as `POST /internal/requests/{request_id}/cancel`: the request stops and
its answer still ends with a final line (finish_reason `abort`) carrying the usage so far. A
caller that gave up on a request sends it too and drops the late lines. A closed channel cancels
every request on it. `ack` names requests by their body's `request_id` (workers/server/ledger.py
keeps each billed request's usage until then). The worker's side is workers/server/channel.py,
the gateway's gateway/upstream/channel.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

MAX_FRAME_BYTES = 64 * 2**20
"""Largest frame either side accepts: a joined (non-streamed) answer holds a whole completion."""

GENERATE = "generate"
CANCEL = "cancel"
ACK = "ack"


class BadFrame(ValueError):
    """Bytes that are not a frame of this protocol."""


@dataclass(frozen=True)
class GenerateFrame:
    id: int
    body: Any  # a GenerateBody (workers/wire/generate.py) from the gateway; unchecked JSON on receipt
    headers: dict[str, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        return orjson.dumps({"op": GENERATE, "id": self.id, "body": self.body, "headers": self.headers})


@dataclass(frozen=True)
class CancelFrame:
    id: int

    def encode(self) -> bytes:
        return orjson.dumps({"op": CANCEL, "id": self.id})


@dataclass(frozen=True)
class AckFrame:
    request_ids: list[str]

    def encode(self) -> bytes:
        return orjson.dumps({"op": ACK, "request_ids": self.request_ids})


@dataclass(frozen=True)
class LinesFrame:
    id: Any
    lines: list[dict[str, Any]]

    def encode(self) -> bytes:
        return orjson.dumps({"id": self.id, "lines": self.lines})


@dataclass(frozen=True)
class ErrorFrame:
    id: Any  # None when the frame it answers could not be read
    status: int
    message: str

    def encode(self) -> bytes:
        return orjson.dumps({"id": self.id, "error": {"status": self.status, "message": self.message}})


def decode_request(data: bytes) -> GenerateFrame | CancelFrame | AckFrame:
    """A caller's frame, as the worker reads it; BadFrame for anything else."""
    try:
        frame = orjson.loads(data)
        op = frame["op"]
        if op == ACK:
            request_ids = frame["request_ids"]
            if not isinstance(request_ids, list) or not all(isinstance(r, str) for r in request_ids):
                raise TypeError("request_ids must be strings")
            return AckFrame(request_ids)
        request_id = frame["id"]
    except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
        raise BadFrame("bad channel frame") from exc
    if op == GENERATE:
        headers = frame.get("headers") or {}
        return GenerateFrame(request_id, frame.get("body"), headers if isinstance(headers, dict) else {})
    if op == CANCEL:
        return CancelFrame(request_id)
    raise BadFrame(f"unknown channel op {op!r}")


def decode_answer(data: bytes) -> LinesFrame | ErrorFrame:
    """A worker's frame, as the caller reads it; BadFrame for anything else."""
    try:
        frame = orjson.loads(data)
        if "error" in frame:
            error = frame["error"]
            return ErrorFrame(frame.get("id"), int(error["status"]), str(error["message"]))
        return LinesFrame(frame.get("id"), list(frame["lines"]))
    except (orjson.JSONDecodeError, TypeError, KeyError, ValueError) as exc:
        raise BadFrame("bad channel frame") from exc
