"""The gateway's end of a worker's generate channel (frames: workers/wire/channel.py): one websocket
per worker, many requests on it at once.

Ownership: a `WorkerChannel` belongs to the pool's entry for one worker URL. It opens its
connection on first use (concurrent first callers share the attempt) and again after the worker
closed it; each `_Connection` owns its reader task, its `Outbox` (workers/wire/outbox.py: the frames
of one loop turn leave as one message when the worker selected `BATCH_PROTOCOL`) and the
`ChannelRequest`s it carries. When a connection ends, every request still on it gets
`ChannelClosed`, at once.

A `ChannelRequest` is passive: the reader task pushes its frames in, its owner takes every line that
arrived so far with one `next_lines()` (a stream's several tokens are one SSE write). Nothing in it
runs on its own, so cancelling a wait for it (aiohttp cancels the handler of a client that left)
leaves the request on the worker intact, and whoever bills it reads on to its final line.

Waits, and what bounds them:
- opening a connection: `connect_timeout_s`;
- sending a frame: `SEND_TIMEOUT_S` per write of the outbox (a worker that stops reading fills the
  socket's buffer; the requests of that write then fail as a closed channel, and the heartbeat ends
  the connection);
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
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp

from workers.wire.channel import (
    BATCH_PROTOCOL,
    MAX_FRAME_BYTES,
    AckFrame,
    BadFrame,
    CancelFrame,
    ErrorFrame,
    GenerateFrame,
    LinesFrame,
    decode_answers,
)
from workers.wire.generate import GenerateBody
from workers.wire.outbox import Flush, Outbox

HEARTBEAT_S = 15.0  # a worker that stops answering pings (a dead host, no RST) ends the connection
SEND_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
ACK_DELAY_S = 0.05
"""Longest an ack waits for a frame to ride with (see WorkerChannel.acknowledge)."""


class ChannelClosed(Exception):
    """The connection to the worker failed or ended before the request did."""


class ChannelRefused(Exception):
    """The worker refused the request (an `error` frame)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class ChannelRequest:
    """One request's answer on one connection (see the module doc). Owned by whoever opened it;
    the connection's reader only calls `push`."""

    __slots__ = ("_items", "_waiter", "channel_id", "finished", "request_id")

    def __init__(self, channel_id: int, request_id: str) -> None:
        self.channel_id, self.request_id = channel_id, request_id
        self.finished = False  # its usage line (or its refusal) was taken
        self._items: deque[LinesFrame | Exception] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def push(self, item: LinesFrame | Exception) -> None:
        """A frame from the worker, or the exception that ends the request (ChannelRefused, ChannelClosed)."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_lines(self) -> list[dict[str, Any]] | None:
        """Every line received since the last call (at least one), in order, the last batch ending
        with the line carrying usage; None after that. Raises ChannelRefused or ChannelClosed."""
        while True:
            if self.finished:
                return None
            while not self._items:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            lines: list[dict[str, Any]] = []
            while self._items and not self.finished:
                item = self._items[0]
                if isinstance(item, Exception):
                    if lines:  # the lines before it first
                        break
                    if isinstance(item, ChannelRefused):  # answered: it ends here
                        self._items.popleft()
                        self.finished = True
                    raise item  # a closed channel stays at the head: later reads see it too
                self._items.popleft()
                for line in item.lines:
                    lines.append(line)
                    if "usage" in line:
                        self.finished = True
                        break
            if lines:
                return lines


class _Connection:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.requests: dict[int, ChannelRequest] = {}  # channel id -> request
        self.channel_ids: dict[str, int] = {}  # request_id (the body's) -> its id on this connection
        self.outbox = Outbox(lambda data: self.ws.send_bytes(data), batched=ws.protocol == BATCH_PROTOCOL,
                             timeout_s=lambda: SEND_TIMEOUT_S)
        self.reader = asyncio.create_task(self._read(), name="tollway-worker-channel")

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                if message.type != aiohttp.WSMsgType.BINARY:
                    continue
                for frame in decode_answers(message.data):
                    request = self.requests.get(frame.id)
                    if request is None:  # a late frame of a request that was given up
                        continue
                    if isinstance(frame, ErrorFrame):
                        request.push(ChannelRefused(frame.status, frame.message))
                    else:
                        request.push(frame)
        except (aiohttp.ClientError, BadFrame, ConnectionError):
            pass
        finally:
            for request in self.requests.values():
                request.push(ChannelClosed("the worker closed the channel"))
            await self.outbox.close()
            await self.ws.close()

    @property
    def open(self) -> bool:
        return not self.ws.closed and not self.reader.done()

    def send_generate(self, request: ChannelRequest, body: GenerateBody, headers: dict[str, str]) -> None:
        """Queue the request's frame (it leaves with this loop turn's others); a failed write of it
        fails the request as a closed channel."""
        flush = self.outbox.put(GenerateFrame(request.channel_id, body, headers).encode())

        def sent(done: asyncio.Future[BaseException | None]) -> None:
            error = done.result()
            if error is not None and not request.finished:
                request.push(ChannelClosed(f"cannot send to the worker: {error!r}"))

        flush.add_done_callback(sent)


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
        self._acks: list[str] = []  # request ids whose usage rows are committed, not sent yet
        self._ack_timer: asyncio.TimerHandle | None = None  # sends them if no generate frame comes first

    @property
    def connected(self) -> bool:
        return self._connection is not None and self._connection.open

    async def _open(self) -> _Connection:
        connection = self._connection
        if connection is not None and connection.open:
            return connection
        async with self._connecting:
            if self._connection is None or not self._connection.open:
                try:
                    async with asyncio.timeout(self._connect_timeout_s):
                        ws = await self._session.ws_connect(self._url, max_msg_size=MAX_FRAME_BYTES, compress=0,
                                                            heartbeat=HEARTBEAT_S, headers=self._headers,
                                                            protocols=(BATCH_PROTOCOL,))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise ChannelClosed(f"cannot open the channel: {exc!r}") from exc
                self._connection = _Connection(ws)
            return self._connection

    async def open_request(self, body: GenerateBody, headers: dict[str, str]) -> ChannelRequest:
        """Send `body` (opening the connection if needed) and return its answer, to read with
        `next_lines()` and end with `release()`. Raises ChannelClosed when the connection cannot
        be opened. Once the connection is open, nothing here waits: the frame is queued at once."""
        connection = await self._open()
        request = ChannelRequest(next(self._ids), body["request_id"])
        connection.requests[request.channel_id] = request
        connection.channel_ids[request.request_id] = request.channel_id
        self._send_acks()  # waiting acks leave in the same write
        connection.send_generate(request, body, headers)
        return request

    async def release(self, request: ChannelRequest) -> None:
        """The owner is done with `request`: forget it, and stop it on the worker unless it ended
        (its late lines are dropped)."""
        connection = self._connection
        if connection is None or connection.requests.get(request.channel_id) is not request:
            return
        del connection.requests[request.channel_id]
        connection.channel_ids.pop(request.request_id, None)
        if not request.finished:
            await self._send_cancel(connection, request.channel_id)

    async def generate(self, body: GenerateBody, headers: dict[str, str]) -> AsyncGenerator[dict[str, Any], None]:
        """The worker's lines for `body`, ending with the one carrying usage. Raises ChannelClosed
        or ChannelRefused. Closing the iterator before the end aborts the request on the worker."""
        request = await self.open_request(body, headers)
        try:
            while (lines := await request.next_lines()) is not None:
                for line in lines:
                    yield line
        finally:
            await self.release(request)

    def acknowledge(self, request_id: str) -> None:
        """This request's usage row is committed: the worker may forget its usage. Acks share one
        frame, sent with the next generate frame to this worker or after ACK_DELAY_S, whichever
        comes first: nothing waits for them, and at one request at a time an ack of its own would
        cost both sides a message (a write, a wakeup, the worker's ledger line) per request. One
        lost with a closed channel only makes the worker offer the request as an orphan, whose row
        then already exists (usage_events.request_id is unique)."""
        if not self._acks:
            self._ack_timer = asyncio.get_running_loop().call_later(ACK_DELAY_S, self._send_acks)
        self._acks.append(request_id)

    def _send_acks(self) -> Flush | None:
        """Queue the waiting acks in one frame; the write they go out in (None: none were waiting, or
        the channel is closed)."""
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        request_ids, self._acks = self._acks, []
        connection = self._connection
        if not request_ids or connection is None or not connection.open:
            return None
        try:
            return connection.outbox.put(AckFrame(request_ids).encode())
        except ConnectionResetError:
            return None

    async def cancel(self, request_id: str) -> bool:
        """The `cancel` verb for a request running on this channel (by the body's `request_id`): its
        answer then ends with an abort line carrying the usage so far. False when it is not here."""
        connection = self._connection
        if connection is None or request_id not in connection.channel_ids:
            return False
        return await self._send_cancel(connection, connection.channel_ids[request_id])

    @staticmethod
    async def _send_cancel(connection: _Connection, channel_id: int) -> bool:
        """Queued behind the request's own frame (so it never overtakes it); True once written."""
        if not connection.open:
            return False
        try:
            flush = connection.outbox.put(CancelFrame(channel_id).encode())
        except ConnectionResetError:
            return False
        return await asyncio.shield(flush) is None  # False: the caller falls back to the HTTP cancel route

    async def close(self) -> None:
        acks = self._send_acks()
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    if acks is not None:  # so the worker does not offer these requests as orphans
                        await asyncio.shield(acks)
                    await connection.ws.close()
            connection.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connection.reader
            await connection.outbox.close()
