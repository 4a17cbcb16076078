"""The sending side of a generate channel (workers/wire/channel.py): frames queued by any task, written
by one writer task, coalesced per turn of the event loop.

Every frame a side produces during one turn of its loop (the lines of one engine step for every
request on the channel, the generate frames of every request a gateway admitted in that turn) goes
out as one websocket message when the peer negotiated `BATCH_PROTOCOL`, instead of one message
(one socket write, one wakeup of the reader) each. Unbatched, the frames go out one message each,
in order, as before. asyncio only: no aiohttp, no torch.

Ownership: one `Outbox` per websocket; after it is made, only its writer task writes to the socket.
Frames keep their order. `put` never waits; a producer that must not run ahead of the socket awaits
`drained()` (the worker's streams do, past `HIGH_WATER_BYTES`), and whoever needs to know a frame
left awaits the `Flush` that `put` returned (its result: None, or the exception that stopped it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from workers.wire.channel import encode_message

HIGH_WATER_BYTES = 4 * 2**20
"""Queued bytes past which `over_high_water()` tells producers to await `drained()`."""

Flush = asyncio.Future[BaseException | None]
"""One write of queued frames: done once they were handed to the socket (None) or failed (the error)."""


class Outbox:
    def __init__(self, send: Callable[[bytes], Awaitable[None]], *, batched: bool,
                 timeout_s: Callable[[], float | None] = lambda: None,
                 on_error: Callable[[BaseException], None] = lambda _: None) -> None:
        """`send` writes one message; `timeout_s()` bounds each write (read at each write);
        `on_error` is told of a write that failed (the frames of that write are lost)."""
        self._send, self._batched, self._timeout_s, self._on_error = send, batched, timeout_s, on_error
        self._frames: list[bytes] = []
        self._bytes = 0
        self._flush: Flush | None = None  # the write the queued frames will go out in
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self.closed = False
        self._writer = asyncio.get_running_loop().create_task(self._write_forever(), name="tollway-channel-outbox")

    def put(self, frame: bytes) -> Flush:
        """Queue one encoded frame; returns the write it will go out in."""
        if self.closed:
            raise ConnectionResetError("the channel is closed")
        if self._flush is None:
            self._flush = asyncio.get_running_loop().create_future()
            self._wake.set()
        self._frames.append(frame)
        self._bytes += len(frame)
        if self._bytes > HIGH_WATER_BYTES:
            self._drained.clear()
        return self._flush

    def over_high_water(self) -> bool:
        return not self._drained.is_set()

    async def drained(self) -> None:
        """Until the queued bytes are below HIGH_WATER_BYTES again (or the outbox closed)."""
        await self._drained.wait()

    async def _write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            frames, flush, self._frames, self._flush, self._bytes = self._frames, self._flush, [], None, 0
            self._drained.set()
            if flush is None:
                continue
            error: BaseException | None = ConnectionResetError("the channel is closed")  # if cancelled
            try:
                for message in [encode_message(frames)] if self._batched else frames:
                    async with asyncio.timeout(self._timeout_s()):
                        await self._send(message)
                error = None
            except Exception as exc:  # the peer is gone or stuck: the frames of this write are lost
                error = exc
                self._on_error(exc)
            finally:
                if not flush.done():
                    flush.set_result(error)

    async def close(self) -> None:
        """Stop writing; frames still queued are dropped (their flush reports ConnectionResetError)."""
        self.closed = True
        self._drained.set()
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer
        if self._flush is not None and not self._flush.done():
            self._flush.set_result(ConnectionResetError("the channel is closed"))
