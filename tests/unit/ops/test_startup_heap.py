"""The serving processes' start-up heap is frozen while they serve, and handed back at shutdown; their
young generation (the gateway's) is collected less often meanwhile.

Checked in a fresh interpreter: in the test process, objects other tests left behind (their event
loops, threads, caches) can die during the check's full collection, and a frozen object that dies
leaves the permanent generation, which would make the exact counts below depend on the test order."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CHECK = textwrap.dedent("""
    import asyncio, gc
    from aiohttp import web
    from aiohttp.test_utils import TestServer
    from ops.startup_heap import YOUNG_THRESHOLD, frozen_startup_heap, rarer_young_collections

    async def main() -> None:
        default = gc.get_threshold()
        app = web.Application()
        app.cleanup_ctx.append(frozen_startup_heap)
        app.cleanup_ctx.append(rarer_young_collections)
        server = TestServer(app)
        await server.start_server()
        try:
            frozen = gc.get_freeze_count()
            assert frozen > 1000, frozen  # the process's modules, at least
            gc.collect()  # a full collection while serving leaves the frozen objects where they are
            assert gc.get_freeze_count() == frozen, (gc.get_freeze_count(), frozen)
            assert gc.get_threshold() == (YOUNG_THRESHOLD, *default[1:]), (gc.get_threshold(), default)
            collections = gc.get_stats()[0]["collections"]
            garbage = [[] for _ in range(1000)]  # more new objects than Python's 700 ...
            for cell in garbage:
                cell.append(cell)  # ... each in a cycle, so only the collector frees them
            del garbage
            assert gc.get_stats()[0]["collections"] == collections  # no young collection for them
        finally:
            await server.close()
        assert gc.get_freeze_count() == 0, gc.get_freeze_count()  # handed back at shutdown
        assert gc.get_threshold() == default, (gc.get_threshold(), default)

    asyncio.run(main())
    print("ok")
""")


def test_the_heap_alive_at_start_up_is_frozen_while_serving_and_released_at_shutdown() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[3])
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
