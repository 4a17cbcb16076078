"""A worker's answer read by its own task, detached from the request handler that started it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

Lines = AsyncGenerator[dict[str, Any], None]


class DetachedStream:
    """A worker stream read by its own task, so cancelling the request's handler (aiohttp does when
    the client hangs up) does not close the worker connection: whoever bills the request can still
    read on to the final line. Iterate it; `aclose()` closes the worker connection."""

    def __init__(self, lines: Lines) -> None:
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._pump(lines))

    async def _pump(self, lines: Lines) -> None:
        try:
            async for line in lines:
                self._queue.put_nowait(("line", line))
            self._queue.put_nowait(("end", None))
        except Exception as exc:  # handed to the reader, raised there
            self._queue.put_nowait(("error", exc))
        finally:
            await lines.aclose()

    def __aiter__(self) -> DetachedStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        kind, value = await self._queue.get()
        if kind == "line":
            return value
        self._queue.put_nowait((kind, value))  # the end (or error) stays visible to later reads
        if kind == "end":
            raise StopAsyncIteration
        raise value

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
