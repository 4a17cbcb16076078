"""GET /internal/channel: many generate requests over one websocket, the gateway's transport.

One HTTP request per generate call costs the gateway more CPU than the rest of its work on a
request (a connection checkout, request and header writing, response parsing, a stream reader).
On this channel a request is one frame each way (more for a stream), all multiplexed on one
connection per gateway process and worker.

Frames are binary, JSON (orjson). The caller numbers its requests (`id`, unique on the channel):
  caller -> worker  {"op": "generate", "id": N, "body": <the POST /internal/generate body>,
                     "headers": {"traceparent": ...}}
                    {"op": "abort", "id": N}          stop N (as closing its HTTP stream would)
  worker -> caller  {"id": N, "lines": [<line>, ...]}  the same lines as the NDJSON answer, in order;
                                                       the one carrying `usage` ends N
                    {"id": N, "error": {"status": 400, "message": ...}}  N was refused
A closed channel aborts every request on it. Both the real worker (workers/server.py) and its test
double (ops/fake_worker.py) serve it through `serve_channel`, with their own `answer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 * 2**20  # as the worker's HTTP body limit

Answer = Callable[[Any, Mapping[str, str]], AsyncIterator[list[dict[str, Any]]]]
"""(generate body, headers) -> batches of lines (an empty one sends nothing); raises ValueError
before its first batch for a 400."""


OPEN_CHANNELS = web.AppKey("open_channels", set)


def setup_channels(app: web.Application) -> None:
    """Track the app's open channels and close them at shutdown (they would hold it up otherwise)."""
    app[OPEN_CHANNELS] = set()

    async def close_channels(app: web.Application) -> None:
        for ws in list(app[OPEN_CHANNELS]):
            await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"worker shutting down")

    app.on_shutdown.append(close_channels)


async def serve_channel(request: web.Request, answer: Answer) -> web.WebSocketResponse:
    """Serve one channel (the app must have run `setup_channels`) until either side closes it."""
    ws = web.WebSocketResponse(max_msg_size=MAX_FRAME_BYTES, compress=False)
    await ws.prepare(request)
    running: dict[Any, asyncio.Task[None]] = {}  # owned by this handler; cancelled when the channel closes
    request.app[OPEN_CHANNELS].add(ws)
    try:
        async for message in ws:
            if message.type != aiohttp.WSMsgType.BINARY:
                continue
            try:
                frame = orjson.loads(message.data)
                op, request_id = frame["op"], frame["id"]
            except (orjson.JSONDecodeError, TypeError, KeyError):
                await _send(ws, {"id": None, "error": {"status": 400, "message": "bad channel frame"}})
                continue
            if op == "generate" and request_id not in running:
                task = asyncio.create_task(_serve(ws, request_id, frame.get("body"), frame.get("headers") or {},
                                                  answer))
                running[request_id] = task
                task.add_done_callback(lambda _, rid=request_id: running.pop(rid, None))
            elif op == "abort" and request_id in running:
                running[request_id].cancel()
            elif op == "generate":
                await _send(ws, {"id": request_id, "error": {"status": 400, "message": "id already in use"}})
    finally:
        request.app[OPEN_CHANNELS].discard(ws)
        for task in list(running.values()):
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
    return ws


async def _serve(ws: web.WebSocketResponse, request_id: Any, body: Any, headers: Mapping[str, str],
                 answer: Answer) -> None:
    lines: AsyncIterator[list[dict[str, Any]]] | None = None
    try:
        try:
            lines = answer(body, headers)
            batch = await anext(lines)
        except ValueError as exc:
            await _send(ws, {"id": request_id, "error": {"status": 400, "message": str(exc)}})
            return
        while batch is not None:
            if batch:
                await _send(ws, {"id": request_id, "lines": batch})
            batch = await anext(lines, None)
    except ConnectionResetError:  # the channel closed: the request is aborted below
        pass
    except Exception:  # never a silent hang for the caller
        log.exception("channel request %r failed", request_id)
        with contextlib.suppress(ConnectionResetError):
            await _send(ws, {"id": request_id, "error": {"status": 500, "message": "the worker failed"}})
    finally:
        if lines is not None:
            await lines.aclose()  # before the end, this aborts the request


async def _send(ws: web.WebSocketResponse, frame: dict[str, Any]) -> None:
    if ws.closed:
        raise ConnectionResetError("the channel is closed")
    await ws.send_bytes(orjson.dumps(frame))
