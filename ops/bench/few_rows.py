"""Matmuls of a few rows, as a decode step runs them (issue 21): in fp32, `tollway_cpu::few_rows_linear`
against MKL's sgemm (plain `F.linear`, and packed for 32 rows as `workers/models/packed_linear.py` packs) and
oneDNN's packed fp32 inner product; with `--dtype bfloat16` (a CPU with AVX512-BF16), its bf16 kernel against
`F.linear` and oneDNN's packed bf16 GEMM (what the native step ran before), and on a CPU with AMX-BF16 up to 32 rows
`amx_rows_linear` (kernels/cpu/native/few_rows_amx.cpp, what the native step runs there).

The weights are those of a whole model's layers, so each matmul reads its weight from memory as a decode step
does (a step reads every layer's weights once; a loop over one weight would find it in cache). For each shape
of the default model's projections and row count M it prints GFLOP/s and GB/s of weight read (the best of
`--rounds` passes over all the weights), and one line of memory bandwidth (`torch.sum` over 400 MB) to read them
against. Runs on a background thread as the engine's step does.

    PYTHONPATH=. .venv/bin/python ops/bench/few_rows.py [--rows 1,4,16,32,64,128] [--rounds 3]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu import native
from workers.models.packed_linear import pack_amx_rows

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
"""(N, K) of SmolLM2-135M's fused projections and head."""
WEIGHT_BYTES = 300 * 2**20
"""Weights allocated per shape: more than any cache, so every pass reads them from memory."""


def best_seconds(run: Callable[[int], object], count: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(count):
            run(i)
        best = min(best, time.perf_counter() - start)
    return best


def memory_line(rounds: int) -> str:
    big = torch.randn(100_000_000)
    seconds = best_seconds(lambda _: big.sum(), 1, rounds)
    return f"memory: torch.sum over 400 MB at {4e8 / seconds / 1e9:.1f} GB/s"


def packed_copies(weights: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """The weights packed for 32 rows, once per shape: MKL's (fp32 only) and oneDNN's where torch has them."""
    packed: dict[str, list[torch.Tensor]] = {}
    if weights[0].dtype == torch.float32:
        packed["mkl"] = [torch.ops.mkl._mkl_reorder_linear_weight(w, 32) for w in weights]
    if torch.backends.mkldnn.is_available():
        packed["dnn"] = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    if weights[0].dtype == torch.bfloat16 and native.amx_rows_available():
        packed["amx"] = [pack_amx_rows(w) for w in weights]
    return packed


def systems_for(x: torch.Tensor, weights: list[torch.Tensor],
                packed: dict[str, list[torch.Tensor]]) -> dict[str, Callable[[int], object]]:
    """Each system's matmul of `x` by weight i."""
    systems: dict[str, Callable[[int], object]] = {"F.linear": lambda i: F.linear(x, weights[i])}
    if "mkl" in packed:
        mkl = packed["mkl"]
        systems["MKL packed(32)"] = lambda i: torch.ops.mkl._mkl_linear(x, mkl[i], weights[i], None, 32)
    systems["few_rows_linear"] = lambda i: torch.ops.tollway_cpu.few_rows_linear(x, weights[i], None)
    if "dnn" in packed:
        dnn = packed["dnn"]
        systems["oneDNN packed"] = lambda i: torch.ops.mkldnn._linear_pointwise(x, dnn[i], None, "none", [], "")
    if "amx" in packed and x.shape[0] <= 32:
        amx = packed["amx"]
        systems["AMX rows"] = lambda i: torch.ops.tollway_cpu.amx_rows_linear(x, amx[i], None)
    return systems


def bench(rows: list[int], rounds: int, dtype: torch.dtype) -> None:
    print(memory_line(rounds))
    size = torch.finfo(dtype).bits // 8
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k).to(dtype) for _ in range(max(2, WEIGHT_BYTES // (n * k * size)))]
        packed = packed_copies(weights)
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            reference = F.linear(x.float(), weights[0].float())
            got = torch.ops.tollway_cpu.few_rows_linear(x, weights[0], None).float()
            error = ((got - reference).abs().max() / reference.abs().max()).item()
            cells = []
            for label, run in systems_for(x, weights, packed).items():
                s = best_seconds(run, len(weights), rounds) / len(weights)
                cells.append(f"{label} {2 * m * n * k / s / 1e9:6.1f} GFLOP/s {n * k * size / s / 1e9:5.1f} GB/s")
            print(f"{name:8} M={m:4d}  " + " | ".join(cells) + f"  (max rel. diff {error:.1e})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,32,64,128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    if not native.load():
        raise SystemExit(f"the native library is needed: {native.unavailable_reason()}")
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    rows = [int(v) for v in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    thread = threading.Thread(target=bench, args=(rows, args.rounds, dtype))  # as the engine's step runs
    thread.start()
    thread.join()


if __name__ == "__main__":
    main()
