"""The serving processes' start-up heap is frozen while they serve, and handed back at shutdown."""

from __future__ import annotations

import gc

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from ops.startup_heap import frozen_startup_heap


@pytest.mark.asyncio
async def test_the_heap_alive_at_start_up_is_frozen_while_serving_and_released_at_shutdown() -> None:
    gc.unfreeze()  # whatever an earlier test left
    app = web.Application()
    app.cleanup_ctx.append(frozen_startup_heap)
    server = TestServer(app)
    await server.start_server()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the test process's modules, at least
        gc.collect()  # a full collection while serving leaves the frozen objects where they are
        assert gc.get_freeze_count() == frozen
    finally:
        await server.close()
    assert gc.get_freeze_count() == 0
