"""Tile sizes of the int4 Triton dequant-matmul on a GPU: `choose_blocks`' pick against a sweep.

`kernels/quantized/triton_matmul.py` chose its tiles under the interpreter; on an H200 its int4 op
ran 2-10x slower than bf16 at the default model's shapes (ops/bench/RESULTS.md). For each linear shape
(in -> out) and rows M (1: one stream; 32: a batch-32 decode step), this times every tile of the sweep
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) inside a CUDA graph (the GPU time alone, as a graphed step
pays it), checks each result against x @ dequantize(W)^T, and prints `choose_blocks`' time, the best
tile's and bf16 `torch.matmul`'s. On a machine without CUDA it says so and exits 0.

    python3 ops/bench/quant_tiles_gpu.py [--repeats 10 --inner 20] [--scales float32]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch

from ops.bench.quant_matmul_gpu import SHAPES, median_us

SWEEP_N, SWEEP_K, SWEEP_WARPS, SWEEP_STAGES = (16, 32, 64), (64, 128, 256, 512), (2, 4, 8), (2, 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--scales", default="float32", choices=["float16", "float32"],
                        help="the scales' dtype on the GPU (the engine keeps the layout's fp32)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quant_tiles_gpu: no CUDA device: not measured (run it on a GPU machine).")
        return 0
    import triton

    from kernels.quantized.layout import dequantize, quantize_int4
    from kernels.quantized.triton_matmul import Blocks, choose_blocks, prepare_for_triton, quantized_matmul

    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name(device)}; int4 group 32, {args.scales} scales, bf16 activations; "
          f"µs per call inside a CUDA graph, median of {args.repeats} x {args.inner}")
    for k, n in SHAPES:
        weight = torch.randn(n, k, device=device) * k**-0.5
        dense = weight.to(torch.bfloat16)
        q = prepare_for_triton(quantize_int4(weight, 32), device, getattr(torch, args.scales))
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            expected = x.float() @ dequantize(q).T
            bf16 = median_us(functools.partial(torch.matmul, x, dense.T), args.repeats, args.inner, graph=True)
            chosen = choose_blocks(m, n, k, 4, 32)
            timed: list[tuple[float, Blocks]] = []
            block_ms = (16,) if m <= 16 else (16, 32)
            for bm, bn, bk, warps, stages in itertools.product(block_ms, SWEEP_N, SWEEP_K, SWEEP_WARPS, SWEEP_STAGES):
                if bk > triton.next_power_of_2(k):
                    continue
                tile = Blocks(bm, bn, bk, warps, stages)
                op = functools.partial(quantized_matmul, x, q, blocks=tile)
                try:
                    error = (op().float() - expected).abs().max().item()
                except Exception as failure:  # a tile the compiler refuses (resources): skipped
                    print(f"  {tile}: {type(failure).__name__}: skipped")
                    continue
                if error > 0.05 * max(1.0, expected.abs().max().item()):  # bf16 products: ~0.01 here
                    print(f"  {tile}: max |error| {error:.3g}: wrong, skipped")
                    continue
                timed.append((median_us(op, args.repeats, args.inner, graph=True), tile))
            default = median_us(functools.partial(quantized_matmul, x, q, blocks=chosen), args.repeats, args.inner,
                                graph=True)
            timed.sort(key=lambda item: item[0])
            best, tile = timed[0]
            print(f"{k:>5} -> {n:<5} M {m:>2}: bf16 {bf16:6.1f} | chosen {default:6.1f} "
                  f"(m{chosen.m} n{chosen.n} k{chosen.k} w{chosen.warps} s{chosen.stages}) | best {best:6.1f} "
                  f"(m{tile.m} n{tile.n} k{tile.k} w{tile.warps} s{tile.stages}) | next: "
                  + ", ".join(f"{t:.1f} (m{b.m} n{b.n} k{b.k} w{b.warps} s{b.stages})" for t, b in timed[1:4]),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
