"""The gateway's end of a worker's generate channel (frames: workers/wire/channel.py): one websocket
per worker, many requests on it at once.

Ownership: a `WorkerChannel` belongs to the pool's entry for one worker URL. It opens its
connection on first use (concurrent first callers share the attempt) and again after the worker
closed it; each `_Connection` owns its reader task and the queues of the requests it carries. When
a connection ends, every request still on it gets `ChannelClosed`, at once.

Waits, and what bounds them:
- opening a connection: `connect_timeout_s`;
- sending a frame: `SEND_TIMEOUT_S` (a worker that stops reading fills the socket's buffer; the
  request then fails as a closed channel, and the heartbeat ends the connection);
- closing: `CLOSE_TIMEOUT_S`;
- waiting for a request's next lines: deliberately no limit of its own. A request may wait long
  in a busy engine's queue, or decode for minutes; what must not happen is waiting on a worker
  that is gone, and the websocket heartbeat (`HEARTBEAT_S`: a ping every 15 s, the connection
  closed when its pong is 7.5 s late) ends the connection, and so every request on it, when the
  worker or its host stops answering. A worker that answers pings but never finishes a request
  is a bug in the worker, not a network fault: the client's own timeout and its hang-up (which
  cancels the request) are what bound that.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp

from workers.wire.channel import (
    MAX_FRAME_BYTES,
    AckFrame,
    BadFrame,
    CancelFrame,
    ErrorFrame,
    GenerateFrame,
    LinesFrame,
    decode_answer,
)
from workers.wire.generate import GenerateBody

HEARTBEAT_S = 15.0  # a worker that stops answering pings (a dead host, no RST) ends the connection
SEND_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
_CLOSED = object()  # put on each waiting queue when the connection ends


class ChannelClosed(Exception):
    """The connection to the worker failed or ended before the request did."""


class ChannelRefused(Exception):
    """The worker refused the request (an `error` frame)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Connection:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.waiting: dict[int, asyncio.Queue[Any]] = {}
        self.channel_ids: dict[str, int] = {}  # request_id (the body's) -> its id on this connection
        self.reader = asyncio.create_task(self._read(), name="tollway-worker-channel")

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                if message.type != aiohttp.WSMsgType.BINARY:
                    continue
                frame = decode_answer(message.data)
                queue = self.waiting.get(frame.id)
                if queue is not None:  # else a late frame of a request that was given up
                    queue.put_nowait(frame)
        except (aiohttp.ClientError, BadFrame, ConnectionError):
            pass
        finally:
            for queue in self.waiting.values():
                queue.put_nowait(_CLOSED)
            await self.ws.close()

    @property
    def open(self) -> bool:
        return not self.ws.closed and not self.reader.done()


class WorkerChannel:
    def __init__(self, url: str, session: aiohttp.ClientSession, connect_timeout_s: float,
                 headers: dict[str, str]) -> None:
        self._url = f"{url}/internal/channel"
        self._session = session
        self._connect_timeout_s = connect_timeout_s
        self._headers = headers  # the workers' credential (Authorization), sent with the upgrade
        self._connection: _Connection | None = None
        self._connecting: asyncio.Lock = asyncio.Lock()
        self._ids = itertools.count()
        self._acks: list[str] = []  # request ids whose usage rows are committed, sent in one frame per loop turn
        self._ack_task: asyncio.Task[None] | None = None

    async def _open(self) -> _Connection:
        connection = self._connection
        if connection is not None and connection.open:
            return connection
        async with self._connecting:
            if self._connection is None or not self._connection.open:
                try:
                    async with asyncio.timeout(self._connect_timeout_s):
                        ws = await self._session.ws_connect(self._url, max_msg_size=MAX_FRAME_BYTES, compress=0,
                                                            heartbeat=HEARTBEAT_S, headers=self._headers)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise ChannelClosed(f"cannot open the channel: {exc!r}") from exc
                self._connection = _Connection(ws)
            return self._connection

    async def generate(self, body: GenerateBody, headers: dict[str, str]) -> AsyncGenerator[dict[str, Any], None]:
        """The worker's lines for `body`, ending with the one carrying usage. Raises ChannelClosed
        or ChannelRefused. Closing the iterator before the end aborts the request on the worker."""
        connection = await self._open()
        request_id = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        connection.waiting[request_id] = queue
        connection.channel_ids[body["request_id"]] = request_id
        finished = False
        try:
            try:
                async with asyncio.timeout(SEND_TIMEOUT_S):
                    await connection.ws.send_bytes(GenerateFrame(request_id, body, headers).encode())
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                raise ChannelClosed(f"cannot send to the worker: {exc!r}") from exc
            while not finished:
                frame: LinesFrame | ErrorFrame | object = await queue.get()
                if isinstance(frame, ErrorFrame):
                    finished = True
                    raise ChannelRefused(frame.status, frame.message)
                if not isinstance(frame, LinesFrame):
                    raise ChannelClosed("the worker closed the channel")
                for line in frame.lines:
                    finished = "usage" in line
                    yield line
        finally:
            connection.waiting.pop(request_id, None)
            connection.channel_ids.pop(body["request_id"], None)
            if not finished:  # given up early: stop it on the worker (its late lines are dropped)
                await self._send_cancel(connection, request_id)

    def acknowledge(self, request_id: str) -> None:
        """This request's usage row is committed: the worker may forget its usage. Acks of one loop
        turn share a frame. One lost with a closed channel only makes the worker offer the request
        as an orphan, whose row then already exists (usage_events.request_id is unique)."""
        if not self._acks:
            self._ack_task = asyncio.get_running_loop().create_task(self._send_acks())
        self._acks.append(request_id)

    async def _send_acks(self) -> None:
        request_ids, self._acks = self._acks, []
        connection = self._connection
        if connection is None or not connection.open:
            return
        with contextlib.suppress(aiohttp.ClientError, ConnectionError):
            await connection.ws.send_bytes(AckFrame(request_ids).encode())

    async def cancel(self, request_id: str) -> bool:
        """The `cancel` verb for a request running on this channel (by the body's `request_id`): its
        answer then ends with an abort line carrying the usage so far. False when it is not here."""
        connection = self._connection
        if connection is None or request_id not in connection.channel_ids:
            return False
        return await self._send_cancel(connection, connection.channel_ids[request_id])

    @staticmethod
    async def _send_cancel(connection: _Connection, channel_id: int) -> bool:
        if not connection.open:
            return False
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await connection.ws.send_bytes(CancelFrame(channel_id).encode())
        except (aiohttp.ClientError, ConnectionError, TimeoutError):
            return False  # the caller falls back to the HTTP cancel route
        return True

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await connection.ws.close()
            connection.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connection.reader
