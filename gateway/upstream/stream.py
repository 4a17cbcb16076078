"""One request's answer from one worker, as the exchange reads it: lines in batches, failures as
the upstream errors the retry rules are written in (gateway/upstream/pool.py).

Made by `WorkerPool.stream`. Passive, like the `ChannelRequest` under it: no task of its own. A
handler cancelled while waiting for it (aiohttp does that when the client hangs up) leaves the
request running on the worker, so the exchange's hang-up task reads on to the final line and bills
it exactly. Its first read sends the request; if the channel must be opened first, that opening and
the send are shielded from such a cancellation, so a request that was on its way always reaches
its worker (and is then stopped and billed), as when a task of its own carried it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

from gateway.upstream.channel import ChannelClosed, ChannelRefused, ChannelRequest, WorkerChannel
from workers.wire.generate import GenerateBody


class UpstreamUnavailable(Exception):
    """The worker could not be reached or refused before streaming anything: safe to retry elsewhere."""


class UpstreamBroken(Exception):
    """The worker failed after the stream began: the request cannot be retried transparently."""


class UpstreamRejected(Exception):
    """The worker answered 4xx: the request itself is bad (retrying elsewhere cannot help)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class UpstreamStream:
    def __init__(self, channel: WorkerChannel, body: GenerateBody, headers: dict[str, str],
                 span: Span | None, mark_down: Callable[[str], None], done: Callable[[], None]) -> None:
        """`mark_down(reason)` takes the worker out of rotation; `done()` is called once, at `aclose`."""
        self._channel, self._body, self._headers = channel, body, headers
        self._span, self._mark_down, self._done = span, mark_down, done
        self._request: ChannelRequest | None = None
        self._opening: asyncio.Future[ChannelRequest] | None = None
        self._closed = False
        self.started = False  # a line arrived: failures from now on are UpstreamBroken

    async def _open(self) -> ChannelRequest:
        if self._request is not None:
            return self._request
        if self._opening is None:
            if self._channel.connected:  # nothing to wait for: the frame is queued right here
                self._request = await self._channel.open_request(self._body, self._headers)
                return self._request
            self._opening = asyncio.ensure_future(self._channel.open_request(self._body, self._headers))
        self._request = await asyncio.shield(self._opening)
        return self._request

    async def next_lines(self) -> list[dict[str, Any]] | None:
        """The lines that arrived since the last call (at least one; the last batch ends with the
        line carrying usage), None after it. Raises UpstreamUnavailable (nothing streamed yet: retry
        elsewhere), UpstreamRejected (4xx) or UpstreamBroken (the stream broke after it began)."""
        try:
            lines = await (await self._open()).next_lines()
        except ChannelRefused as exc:
            if 400 <= exc.status < 500:
                error: Exception = UpstreamRejected(exc.status, exc.message)
            else:
                error = (UpstreamBroken if self.started else UpstreamUnavailable)(f"worker answered {exc.status}")
            raise self._failed(error) from exc
        except ChannelClosed as exc:
            self._mark_down(str(exc))
            raise self._failed((UpstreamBroken if self.started else UpstreamUnavailable)(str(exc))) from exc
        if lines:
            self.started = True
        return lines

    def _failed(self, error: Exception) -> Exception:
        if self._span is not None:
            self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        return error

    async def aclose(self) -> None:
        """End it: an unfinished request is stopped on the worker. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._request is None and self._opening is not None:
                with contextlib.suppress(ChannelClosed):
                    self._request = await asyncio.shield(self._opening)
            if self._request is not None:
                await self._channel.release(self._request)
        finally:
            self._done()
            if self._span is not None:
                self._span.end()
