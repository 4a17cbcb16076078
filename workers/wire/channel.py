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

Batched messages (negotiated): a caller that opens the channel with the websocket subprotocol
`BATCH_PROTOCOL`, and a worker that selects it, may each put several frames in one message, as a
JSON array of frame objects (what one side produced during one turn of its event loop: every
line of one engine step for all the requests on the channel, or every request a gateway admitted
in one turn). A message holding one frame is the plain object either way, so a caller that does not
offer the subprotocol sees exactly the unbatched protocol.

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

BATCH_PROTOCOL = "tollway.frames.batched"
"""The websocket subprotocol under which a message may hold a JSON array of frames."""

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


def encode_message(frames: list[bytes]) -> bytes:
    """Encoded frames as one message: the frame itself when alone, else a JSON array of them (only
    under `BATCH_PROTOCOL`)."""
    if len(frames) == 1:
        return frames[0]
    return b"[" + b",".join(frames) + b"]"


def _loads(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BadFrame("bad channel frame") from exc


def _request_frame(frame: Any) -> GenerateFrame | CancelFrame | AckFrame:
    try:
        op = frame["op"]
        if op == ACK:
            request_ids = frame["request_ids"]
            if not isinstance(request_ids, list) or not all(isinstance(r, str) for r in request_ids):
                raise TypeError("request_ids must be strings")
            return AckFrame(request_ids)
        request_id = frame["id"]
    except (TypeError, KeyError) as exc:
        raise BadFrame("bad channel frame") from exc
    if op == GENERATE:
        headers = frame.get("headers") or {}
        return GenerateFrame(request_id, frame.get("body"), headers if isinstance(headers, dict) else {})
    if op == CANCEL:
        return CancelFrame(request_id)
    raise BadFrame(f"unknown channel op {op!r}")


def _answer_frame(frame: Any) -> LinesFrame | ErrorFrame:
    try:
        if "error" in frame:
            error = frame["error"]
            return ErrorFrame(frame.get("id"), int(error["status"]), str(error["message"]))
        return LinesFrame(frame.get("id"), list(frame["lines"]))
    except (TypeError, KeyError, ValueError) as exc:
        raise BadFrame("bad channel frame") from exc


def decode_request(data: bytes) -> GenerateFrame | CancelFrame | AckFrame:
    """A caller's frame, as the worker reads it; BadFrame for anything else."""
    return _request_frame(_loads(data))


def decode_requests(data: bytes) -> list[GenerateFrame | CancelFrame | AckFrame | BadFrame]:
    """A caller's message under `BATCH_PROTOCOL`: its frames in order, a BadFrame in place of each
    one that cannot be read (the message as a whole is one BadFrame when it is not JSON)."""
    try:
        message = _loads(data)
    except BadFrame as exc:
        return [exc]
    out: list[GenerateFrame | CancelFrame | AckFrame | BadFrame] = []
    for frame in message if isinstance(message, list) else [message]:
        try:
            out.append(_request_frame(frame))
        except BadFrame as exc:
            out.append(exc)
    return out


def decode_answer(data: bytes) -> LinesFrame | ErrorFrame:
    """A worker's frame, as the caller reads it; BadFrame for anything else."""
    return _answer_frame(_loads(data))


def decode_answers(data: bytes) -> list[LinesFrame | ErrorFrame]:
    """A worker's message under `BATCH_PROTOCOL`: its frames in order; BadFrame for anything else."""
    message = _loads(data)
    return [_answer_frame(frame) for frame in message] if isinstance(message, list) else [_answer_frame(message)]
