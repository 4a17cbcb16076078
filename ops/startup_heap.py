"""Keeping a serving process's start-up heap out of the garbage collector's way.

A full collection walks every tracked object with the event loop (and every other thread) stopped.
After start-up most of those objects live as long as the process: modules, the tokenizer's Python
side, SQLAlchemy's and OpenTelemetry's registries, a worker's model and torch/transformers state.
Measured: ~130k objects and 17–75 ms in a gateway process, ~320k objects and 167–203 ms in an engine
worker (ops/bench/RESULTS.md). `frozen_startup_heap` moves them to the permanent generation once
everything has started, so later collections scan only what serving allocated; at shutdown they are
handed back, so interpreter exit frees them as before.

For serving processes only (`tollway gateway`, `tollway worker`, the fake worker's process): a test
process that makes many apps would pin every one of them.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator

from aiohttp import web


async def frozen_startup_heap(_app: web.Application) -> AsyncIterator[None]:
    """A cleanup_ctx: append it last, so every other start-up has run before the freeze."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
