"""Keeping a serving process's start-up heap out of the garbage collector's way, and the gateway's
collector from walking its requests in flight over and over.

A full collection walks every tracked object with the event loop (and every other thread) stopped.
After start-up most of those objects live as long as the process: modules, the tokenizer's Python
side, SQLAlchemy's and OpenTelemetry's registries, a worker's model and torch/transformers state.
Measured: ~130k objects and 17–75 ms in a gateway process, ~320k objects and 167–203 ms in an engine
worker (ops/bench/RESULTS.md). `frozen_startup_heap` moves them to the permanent generation once
everything has started, so later collections scan only what serving allocated; at shutdown they are
handed back, so interpreter exit frees them as before.

`rarer_young_collections` (the gateway's) collects the youngest generation after `YOUNG_THRESHOLD` net
allocations of tracked objects instead of Python's 700. A gateway makes almost no cyclic garbage
(~2,000 objects freed by the collector over ~40,000 requests), but at 700 a young collection comes
every few ms under load and finds the objects of the requests in flight still alive: it walks them,
promotes them, and the older collections walk them again. Measured over one run of
`ops.bench.gateway_overhead` (C = 1 and 64, 8 s each; `ops/bench/gc_probe`): 1,470 young, 134 middle
and 12 full collections, 770 ms in all; at 5,000: 45, 4 and 1, 170 ms, young collections ~1 ms each;
under `perf` at C = 64 the collector's functions went from 5.3% of the gateway's CPU to none sampled.
An engine worker keeps Python's thresholds: its cyclic garbage may hold activations, which rarer
collections would free later (not tried there).

For serving processes only (`tollway gateway`, `tollway worker`, the fake worker's process): a test
process that makes many apps would pin every one of them.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator

from aiohttp import web

YOUNG_THRESHOLD = 5000
"""Net allocations of tracked objects between young collections while serving (Python's default: 700)."""


async def frozen_startup_heap(_app: web.Application) -> AsyncIterator[None]:
    """A cleanup_ctx: append it last, so every other start-up has run before the freeze."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


async def rarer_young_collections(_app: web.Application) -> AsyncIterator[None]:
    """A cleanup_ctx: the youngest generation collected every YOUNG_THRESHOLD net allocations while
    serving; Python's thresholds back at shutdown."""
    thresholds = gc.get_threshold()
    gc.set_threshold(max(YOUNG_THRESHOLD, thresholds[0]), *thresholds[1:])
    yield
    gc.set_threshold(*thresholds)
