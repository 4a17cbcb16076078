"""Paged attention on the CPU: our CPU path vs the torch reference vs SDPA over contiguous KV.

Shapes are the default model's (9 query heads, 3 KV heads, head dim 64), blocks of 16 in shuffled
order. Each figure is the best of N calls, in µs per call (one layer). "CPU path" reuses the
step's prepared gather indices and masks, as every layer after the first does; "prepare" is that
once-per-step cost.

    .venv/bin/python ops/bench/attention_cpu.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu, reference
from kernels.metadata import PagedAttentionMetadata

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def best_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def paged_batch(query_lens: list[int], context_lens: list[int], dtype: torch.dtype):
    """Metadata, caches holding every context in shuffled blocks, and the step's q/k/v."""
    needed = [-(-n // BLOCK_SIZE) for n in context_lens]
    order = torch.randperm(sum(needed)).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n])
        used += n
    meta = PagedAttentionMetadata.build(query_lens, context_lens, tables, BLOCK_SIZE)
    shape = (sum(needed), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    n = meta.num_tokens
    q = torch.randn(n, Q_HEADS, HEAD_DIM, dtype=dtype)
    k, v = torch.randn(n, KV_HEADS, HEAD_DIM, dtype=dtype), torch.randn(n, KV_HEADS, HEAD_DIM, dtype=dtype)
    return meta, k_cache, v_cache, q, k, v


def bench_decode(dtype: torch.dtype, batch: int, context: int, repeats: int) -> dict[str, float]:
    meta, k_cache, v_cache, q, _, _ = paged_batch([1] * batch, [context] * batch, dtype)
    tables, lens = meta.block_tables, meta.context_lens
    plan = cpu.prepare_decode(tables, lens, BLOCK_SIZE, dtype, None)
    contiguous_k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, dtype=dtype)
    contiguous_v = torch.randn(batch, KV_HEADS, context, HEAD_DIM, dtype=dtype)
    return {
        "CPU path": best_us(lambda: cpu.decode_attention(q, k_cache, v_cache, tables, lens, SCALE, plan=plan), repeats),
        "prepare (once per step)": best_us(lambda: cpu.prepare_decode(tables, lens, BLOCK_SIZE, dtype, None), repeats),
        "reference": best_us(lambda: reference.decode_attention(q, k_cache, v_cache, tables, lens, SCALE), 3),
        "contiguous SDPA": best_us(lambda: F.scaled_dot_product_attention(
            q.unsqueeze(2), contiguous_k, contiguous_v, scale=SCALE, enable_gqa=True), repeats),
    }


def bench_extend(dtype: torch.dtype, batch: int, prefix: int, new: int, repeats: int) -> dict[str, float]:
    meta, k_cache, v_cache, q, k, v = paged_batch([new] * batch, [prefix + new] * batch, dtype)
    args = (q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.context_lens, SCALE)
    starts, lens = meta.query_start.tolist(), meta.context_lens_list
    plan = cpu.prepare_extend(meta.block_tables, starts, lens, BLOCK_SIZE, dtype, None)
    length = prefix + new
    contiguous_q = q.view(batch, new, Q_HEADS, HEAD_DIM).transpose(1, 2)
    contiguous_k = torch.randn(batch, KV_HEADS, length, HEAD_DIM, dtype=dtype)
    contiguous_v = torch.randn(batch, KV_HEADS, length, HEAD_DIM, dtype=dtype)
    mask = torch.arange(length)[None, :] <= torch.arange(prefix, length)[:, None]
    return {
        "CPU path": best_us(lambda: cpu.extend_attention(*args, plan=plan, new_keys=k, new_values=v), repeats),
        "prepare (once per step)": best_us(
            lambda: cpu.prepare_extend(meta.block_tables, starts, lens, BLOCK_SIZE, dtype, None), repeats),
        "reference": best_us(lambda: reference.extend_attention(*args), 3),
        "contiguous SDPA": best_us(lambda: F.scaled_dot_product_attention(
            contiguous_q, contiguous_k, contiguous_v, attn_mask=None if prefix == 0 else mask,
            is_causal=prefix == 0, scale=SCALE, enable_gqa=True), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    cases = [
        ("decode, batch 32, context 512", lambda dt: bench_decode(dt, 32, 512, args.repeats)),
        ("extend, 4 x (256 cached + 128 new)", lambda dt: bench_extend(dt, 4, 256, 128, args.repeats)),
        ("extend, 1 x (0 cached + 512 new)", lambda dt: bench_extend(dt, 1, 0, 512, args.repeats)),
    ]
    print(f"threads={torch.get_num_threads()}  heads {Q_HEADS}/{KV_HEADS}  head dim {HEAD_DIM}  "
          f"block {BLOCK_SIZE}  (µs per call, best of {args.repeats}; reference best of 3)")
    print(f"{'dtype':9} {'case':36} {'CPU path':>9} {'prepare':>8} {'reference':>10} {'contig SDPA':>12} "
          f"{'path/SDPA':>10}")
    for dtype in (torch.float32, torch.bfloat16):
        for name, run in cases:
            r = run(dtype)
            print(f"{str(dtype).removeprefix('torch.'):9} {name:36} {r['CPU path']:9.0f} "
                  f"{r['prepare (once per step)']:8.0f} {r['reference']:10.0f} {r['contiguous SDPA']:12.0f} "
                  f"{r['CPU path'] / r['contiguous SDPA']:9.2f}×")


if __name__ == "__main__":
    main()
