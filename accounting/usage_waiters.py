"""How the usage writer's thread tells its callers how their writes went.

A caller waits on a `Waiter`: `UsageWriter.submit`'s concurrent future, or `UsageWriter.write`'s
asyncio future on the caller's event loop. `settle` runs on the writer thread, once per batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import TypeAlias

log = logging.getLogger("accounting.usage_writer")  # the writer's parts log as the writer

Waiter: TypeAlias = "concurrent.futures.Future[None] | asyncio.Future[None]"
"""Who waits for one queued record: submit()'s future, or write()'s future on its event loop."""


def settle(outcomes: list[tuple[Waiter, BaseException | None]]) -> None:
    """Tell the waiters how their writes went (None: durable). Runs on the writer thread.

    submit()'s futures are RUNNING, so only this can settle them. write()'s futures belong to
    their event loop: they are settled there, with one wake-up per loop for the whole list.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], BaseException | None]]] = {}
    for waiter, error in outcomes:
        if isinstance(waiter, asyncio.Future):
            by_loop.setdefault(waiter.get_loop(), []).append((waiter, error))
        elif error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(error)
    for loop, loop_outcomes in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle_on_loop, loop_outcomes)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            log.debug("usage writes settled after their event loop closed")


def _settle_on_loop(outcomes: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for future, error in outcomes:
        if future.done():  # its task was cancelled: the row is written all the same
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
