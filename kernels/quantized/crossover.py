"""Where the native row kernel stops paying, measured on this CPU when an engine starts (issue 22).

A native quantized matmul runs its row kernel below a number of rows of x and, from there, the tile
kernel (bf16, up to `TILE_GEMM_MAX_ROWS`) or dequantizes the weight + runs one GEMM
(`kernels/quantized/cpu.py: dequantize_from_rows`, `dense_matmul`). The shipped
`DEQUANTIZE_FROM_ROWS` / `Q8_DEQUANTIZE_FROM_ROWS` were measured on one host, and hosts with the very
same CPU flags disagree: bf16 int8's crossover was 48+ rows on one 2-core AVX512-BF16 EPYC and 16-32
on another (ops/bench/RESULTS.md, "Issue 22"). So `calibrate` times a model's own projections both
ways at growing row counts, once per process and (dtype, bits, x rounded to int8), and records the
first count at which dequantize + GEMM wins at that count and the next; `dequantize_from_rows` then
uses it. Both ways compute the same product (to rounding), so a choice changes speed, never results
beyond the dtype's rounding.

Timing: each way runs over up to `MAX_LAYERS` layers' projections (distinct weights, streamed from
memory as a step reads them), best of `ROUNDS` rounds. It costs 1-3 s at start on a 2-core host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from kernels.quantized import cpu as qcpu

log = logging.getLogger(__name__)

FLOAT_ROWS = (8, 16, 24, 32, 48, 64, 96, 128)
"""Row counts tried for the float row kernels (prefill on bf16; every step on fp32)."""
Q8_ROWS = (16, 32, 48, 64, 96, 128, 192, 256)
"""Row counts tried for the int8-activation kernels (decode steps of quantized models)."""
MAX_LAYERS = 12  # their int8 weights (42 MB for the default model) outgrow a 2-core host's cache share
ROUNDS = 3

Matmul = Callable[[torch.Tensor], torch.Tensor]


def first_win(row_cost: Callable[[int], float], dequantize_cost: Callable[[int], float],
              candidates: Sequence[int]) -> int:
    """The smallest candidate from which dequantize + GEMM costs less at it and at the next candidate
    (one noisy reading does not move the crossover); past the last candidate: twice the last."""
    wins: dict[int, bool] = {}

    def win(i: int) -> bool:  # measured lazily: the large counts only when the small ones lost
        if i not in wins:
            wins[i] = dequantize_cost(candidates[i]) < row_cost(candidates[i])
        return wins[i]

    for i, m in enumerate(candidates):
        if win(i) and (i + 1 == len(candidates) or win(i + 1)):
            return m
    return 2 * candidates[-1]


def _best_time(calls: Sequence[tuple[Matmul, torch.Tensor]]) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for run, x in calls:
            run(x)
        best = min(best, time.perf_counter() - start)
    return best


def _dense_matmul(packed: qcpu.CpuPacked) -> Matmul:
    """What runs from the crossover on: the tile kernel where it fits, else dequantize + one GEMM."""
    return lambda x: qcpu.dense_matmul(x.contiguous(), packed)


def measure(packings: Sequence[qcpu.CpuPacked], rounded: bool, candidates: Sequence[int]) -> int:
    """The crossover (rows) of these native packings' row kernels (`rounded`: the int8-activation ones)."""
    gen = torch.Generator().manual_seed(0)
    inputs: dict[tuple[int, int], torch.Tensor] = {}

    def calls(m: int, way: Callable[[qcpu.CpuPacked], Matmul]) -> list[tuple[Matmul, torch.Tensor]]:
        out = []
        for packed in packings:
            k = packed.shape[1]
            if (m, k) not in inputs:
                inputs[(m, k)] = torch.randn(m, k, generator=gen).to(packed.dtype)
            out.append((way(packed), inputs[(m, k)]))
        return out

    def rows(packed: qcpu.CpuPacked) -> Matmul:
        run = qcpu.row_kernel(packed, rounded)
        assert run is not None
        return run

    with torch.inference_mode():
        return first_win(lambda m: _best_time(calls(m, rows)),
                         lambda m: _best_time(calls(m, _dense_matmul)), candidates)


def calibrate(packings: Sequence[qcpu.CpuPacked]) -> dict[tuple[torch.dtype, int, bool], int]:
    """Measure and record (`qcpu.record_crossover`) the crossover of each (dtype, bits, rounded) among
    these native packings not yet measured in this process; returns what it recorded."""
    groups: dict[tuple[torch.dtype, int, bool], list[qcpu.CpuPacked]] = {}
    for packed in packings:
        if packed.kernel != "native":
            continue
        for rounded in dict.fromkeys((False, packed.int8_activations)):
            key = (packed.dtype, packed.bits, rounded)
            if qcpu.measured_crossover(*key) is None:
                groups.setdefault(key, []).append(packed)
    recorded = {}
    for (dtype, bits, rounded), group in groups.items():
        start = time.perf_counter()
        rows = measure(group[: 4 * MAX_LAYERS], rounded, Q8_ROWS if rounded else FLOAT_ROWS)
        qcpu.record_crossover(dtype, bits, rounded, rows)
        recorded[(dtype, bits, rounded)] = rows
        log.info("quantized matmul crossover on this CPU: %s int%d%s dequantizes from %d rows (measured in %.2f s)",
                 str(dtype).removeprefix("torch."), bits, " (x as int8)" if rounded else "", rows,
                 time.perf_counter() - start)
    return recorded
