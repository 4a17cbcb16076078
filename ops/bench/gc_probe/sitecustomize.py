"""A garbage-collection probe for benchmark runs: put this folder on PYTHONPATH and every Python
process started with it counts its collections per generation, their wall time and what they freed,
and writes them at exit to `$GC_PROBE_DIR/gc.<pid>` (the directory must exist).

    mkdir -p /tmp/gc && GC_PROBE_DIR=/tmp/gc PYTHONPATH=$PWD/ops/bench/gc_probe \\
        .venv/bin/python -m ops.bench.gateway_overhead --seconds 8 --concurrency 1,64 --no-stream
    cat /tmp/gc/gc.*   # one file per process: its command line, then a line per generation

Measurement only: nothing in tollway imports it. Without GC_PROBE_DIR it does nothing (not a TOLLWAY_
variable: the benches do not pass those on to the processes they start).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
from typing import Any

_DIRECTORY = os.environ.get("GC_PROBE_DIR")


class _Probe:
    def __init__(self) -> None:
        self.started = 0.0
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.collected = [0, 0, 0]

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += time.perf_counter() - self.started
        self.collected[generation] += info.get("collected", 0)

    def write(self, directory: str) -> None:
        with open(os.path.join(directory, f"gc.{os.getpid()}"), "w") as out:
            out.write(" ".join(sys.orig_argv) + "\n")
            for generation in range(3):
                count, ms = self.collections[generation], self.seconds[generation] * 1e3
                out.write(f"generation {generation}: {count} collections, {ms:.1f} ms, "
                          f"{self.collected[generation]} objects freed\n")


if _DIRECTORY:
    _probe = _Probe()
    gc.callbacks.append(_probe)
    atexit.register(_probe.write, _DIRECTORY)
