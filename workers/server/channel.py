"""The worker's side of the generate channel (`GET /internal/channel`; frames: workers/wire/channel.py).

One HTTP request per generate call costs the gateway more CPU than the rest of its work on a
request (a connection checkout, request and header writing, response parsing, a stream reader).
On this channel a request is one frame each way (more for a stream), all multiplexed on one
connection per gateway process and worker. Both the real worker (workers/server/app.py) and its
test double (ops/fake_worker.py) serve it through `serve_channel`, with their own `answer` and
`cancel`. A closed channel aborts every request still running on it.

Frames go out through an `Outbox` (workers/wire/outbox.py): when the caller offered
`BATCH_PROTOCOL`, everything answered during one turn of the loop (one engine step's lines for every
request on the channel) is one message, not one per request and token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from workers.server.billing import WorkerBilling
from workers.wire.channel import (
    BATCH_PROTOCOL,
    MAX_FRAME_BYTES,
    AckFrame,
    BadFrame,
    CancelFrame,
    ErrorFrame,
    GenerateFrame,
    LinesFrame,
    decode_request,
    decode_requests,
)
from workers.wire.outbox import Outbox

log = logging.getLogger(__name__)

Answer = Callable[[Any, Mapping[str, str], object], AsyncGenerator[list[dict[str, Any]], None]]
"""(generate body, headers, owner) -> batches of lines (an empty one sends nothing); raises
ValueError before its first batch for a 400. `owner` is the channel's billing token."""
Cancel = Callable[[str], None]
"""Stop the request with this `request_id` (the body's): its answer ends with the abort line."""


OPEN_CHANNELS = web.AppKey("open_channels", set[web.WebSocketResponse])


def setup_channels(app: web.Application) -> None:
    """Track the app's open channels and close them at shutdown (they would hold it up otherwise)."""
    app[OPEN_CHANNELS] = set()

    async def close_channels(app: web.Application) -> None:
        channels = app[OPEN_CHANNELS]
        for ws in list(channels):
            await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"worker shutting down")

    app.on_shutdown.append(close_channels)


async def serve_channel(request: web.Request, answer: Answer, cancel: Cancel,
                        billing: WorkerBilling) -> web.WebSocketResponse:
    """Serve one channel (the app must have run `setup_channels`) until either side closes it.
    Billed requests it carries are owned by it until then (workers/server/billing.py)."""
    ws = web.WebSocketResponse(max_msg_size=MAX_FRAME_BYTES, compress=False, protocols=(BATCH_PROTOCOL,))
    await ws.prepare(request)
    batched = ws.ws_protocol == BATCH_PROTOCOL
    closing: set[asyncio.Task[bool]] = set()

    def write_failed(_: BaseException) -> None:  # the gateway is gone: end the channel (and its requests)
        closing.add(asyncio.ensure_future(ws.close()))

    outbox = Outbox(ws.send_bytes, batched=batched, on_error=write_failed)
    owner = billing.open_channel()
    # Owned by this handler: channel id -> its task (cancelled when the channel closes) and the
    # body's request_id (what `cancel` names).
    running: dict[Any, asyncio.Task[None]] = {}
    request_ids: dict[Any, str] = {}
    request.app[OPEN_CHANNELS].add(ws)
    try:
        async for message in ws:
            if message.type != aiohttp.WSMsgType.BINARY:
                continue
            frames: list[GenerateFrame | CancelFrame | AckFrame | BadFrame]
            if batched:
                frames = decode_requests(message.data)
            else:
                try:
                    frames = [decode_request(message.data)]
                except BadFrame as exc:
                    frames = [exc]
            for frame in frames:
                if isinstance(frame, BadFrame):
                    _send(outbox, ErrorFrame(None, 400, str(frame)))
                elif isinstance(frame, GenerateFrame):
                    if frame.id in running:
                        _send(outbox, ErrorFrame(frame.id, 400, "id already in use"))
                        continue
                    task = asyncio.create_task(_serve(outbox, frame, answer, owner))
                    running[frame.id] = task
                    if isinstance(frame.body, dict) and isinstance(frame.body.get("request_id"), str):
                        request_ids[frame.id] = frame.body["request_id"]

                    def forget(_: object, channel_id: Any = frame.id) -> None:
                        running.pop(channel_id, None)
                        request_ids.pop(channel_id, None)

                    task.add_done_callback(forget)
                elif isinstance(frame, AckFrame):
                    billing.acknowledge(frame.request_ids)
                elif isinstance(frame, CancelFrame) and frame.id in running:
                    if frame.id in request_ids:
                        cancel(request_ids[frame.id])
                    else:  # refused before it ran: nothing to bill, stop the task
                        running[frame.id].cancel()
    finally:
        request.app[OPEN_CHANNELS].discard(ws)
        for task in list(running.values()):
            task.cancel()
        try:
            await asyncio.gather(*running.values(), return_exceptions=True)
        finally:  # even when this handler is cancelled too (the caller vanished)
            billing.close_channel(owner)  # what its gateway did not acknowledge is now an orphan
            await outbox.close()
    return ws


async def _serve(outbox: Outbox, frame: GenerateFrame, answer: Answer, owner: object) -> None:
    lines: AsyncGenerator[list[dict[str, Any]], None] | None = None
    try:
        try:
            lines = answer(frame.body, frame.headers, owner)
            batch: list[dict[str, Any]] | None = await anext(lines)
        except ValueError as exc:
            _send(outbox, ErrorFrame(frame.id, 400, str(exc)))
            return
        while batch is not None:
            if batch:
                _send(outbox, LinesFrame(frame.id, batch))
                if outbox.over_high_water():  # the caller reads slower than the engine answers
                    await outbox.drained()
            batch = await anext(lines, None)
    except ConnectionResetError:  # the channel closed: the request is aborted below
        pass
    except Exception:  # never a silent hang for the caller
        log.exception("channel request %r failed", frame.id)
        with contextlib.suppress(ConnectionResetError):
            _send(outbox, ErrorFrame(frame.id, 500, "the worker failed"))
    finally:
        if lines is not None:
            await lines.aclose()  # before the end, this aborts the request


def _send(outbox: Outbox, frame: LinesFrame | ErrorFrame) -> None:
    """Queue a frame (it leaves with the others of this loop turn); ConnectionResetError once closed."""
    outbox.put(frame.encode())
