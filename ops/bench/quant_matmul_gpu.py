"""Triton dequant-matmul on a GPU: int8 / int4 `quantized_matmul` against torch.matmul on bf16 weights.

The default model's linear shapes (in -> out: 576 -> 960 q/k/v, 576 -> 576 o, 576 -> 3072 gate/up,
1536 -> 576 down) at M = 1, 8, 32 rows, bf16 activations. int8 is per channel; int4 is group 32
(GGUF Q4_1's blocks) with fp32 scales and with fp16 scales (`prepare_for_triton`'s two choices).
Each op is timed two ways, median of `--repeats` rounds of `--inner` back-to-back calls:
"eager" (Python launches included, as a model step without graphs pays them) and "graph" (the
same calls captured in a CUDA graph: the GPU time alone). Also printed: each result's max
|difference| from x @ dequantize(W)^T in fp32, and the weight bytes each op reads.
On a machine without CUDA it says so and exits 0.

    .venv/bin/python ops/bench/quant_matmul_gpu.py [--repeats 20] [--inner 50]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable

import torch

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K in, N out)
ROWS = [1, 8, 32]


def median_us(fn: Callable[[], object], repeats: int, inner: int, graph: bool) -> float:
    """Median over `repeats` of the mean time of `inner` calls, in µs (fn already warmed up)."""
    run: Callable[[], object]
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # a warm call on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(inner):
                fn()
        run = captured.replay
    else:
        def run() -> None:
            for _ in range(inner):
                fn()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times)


def cell(cells: dict[str, tuple[float, float]], name: str) -> str:
    eager, graph = cells[name]
    return f"{eager:6.1f}/{graph:6.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--inner", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quant_matmul_gpu: no CUDA device: not measured (run it on a GPU machine).")
        return 0
    from kernels.quantized.layout import dequantize, quantize_int4, quantize_int8
    from kernels.quantized.triton_matmul import prepare_for_triton, quantized_matmul

    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name(device)}; bf16 activations; times in µs per call "
          f"(eager / CUDA graph), median of {args.repeats} x {args.inner} calls")
    header = (f"{'K -> N':>12} {'M':>3} | {'bf16 matmul':>13} | {'int8':>13} {'x':>5} | {'int4 fp32 sc':>13} "
              f"{'x':>5} | {'int4 fp16 sc':>13} {'x':>5} | max |err| i8/i4/i4h")
    print(header)
    print("-" * len(header))
    for k, n in SHAPES:
        weight = torch.randn(n, k, device=device) * k**-0.5
        dense = weight.to(torch.bfloat16)
        variants = {
            "int8": prepare_for_triton(quantize_int8(weight), device),
            "int4": prepare_for_triton(quantize_int4(weight, 32), device),
            "int4h": prepare_for_triton(quantize_int4(weight, 32), device, torch.float16),
        }
        for m in ROWS:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ops: dict[str, Callable[[], torch.Tensor]] = {"bf16": functools.partial(torch.matmul, x, dense.T)}
            errors = []
            for name, q in variants.items():
                ops[name] = functools.partial(quantized_matmul, x, q)
                expected = x.float() @ dequantize(q).T
                errors.append((ops[name]().float() - expected).abs().max().item())
            ops["bf16"]()
            torch.cuda.synchronize()
            cells = {name: (median_us(fn, args.repeats, args.inner, graph=False),
                            median_us(fn, args.repeats, args.inner, graph=True)) for name, fn in ops.items()}
            speedups = [f"{cell(cells, name):>13} {cells['bf16'][1] / cells[name][1]:4.2f}x" for name in variants]
            print(f"{k:>5} -> {n:<4} {m:>3} | {cell(cells, 'bf16'):>13} | " + " | ".join(speedups)
                  + " | " + "/".join(f"{e:.1e}" for e in errors))
        read = {"bf16": dense.numel() * 2, **{name: q.nbytes() for name, q in variants.items()}}
        print(f"{'':>16}weight bytes read: " + ", ".join(f"{name} {b / 1e3:.0f} kB" for name, b in read.items()))
    print("x = bf16 graph time / quantized graph time (> 1: the quantized op is faster on the GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
