"""The native `paged_decode` op alone (issue 21): one decode step's attention over 30 layers' caches,
the default model's shape (3 KV heads x 3 query heads, head dim 64, blocks of 8), in three layouts:

- scattered: every sequence's blocks at random places, each layer its own cache (what a cache
  that has served a while holds: freed, evicted and shared blocks), streamed from DRAM;
- contiguous: each sequence's blocks in order (a fresh cache, prefilled sequence by sequence);
- warm: the scattered layout, one layer's cache read 30 times (it stays in L2/L3: the op's compute);
- uneven: scattered, the batch's first half at 1.8x the context and its second at 0.2x (the same tokens in
  all): how the threads share a batch whose long contexts sit together (tasks are claimed longest first).

Then prefill rows (what a chunked prefill step sends, workers/models/fused_decode.py): each new token of a prompt
is a row reading the prompt's blocks up to its own position; one 380-token prompt, and a 1,024-row chunk of three.
Under an fp32 q or a bf16 q over an int8 cache (kernels/cpu/native/paged_prefill.h), or a bf16 q over a bf16 cache
on AVX512-BF16 (paged_prefill_bf16.h), such runs attend as tiles.

With `--against-sdpa 512,1024,...`: one fresh sequence of each length, one layer, prefill rows against torch's
flash SDPA (causal, `enable_gqa`) on the same shapes: the bounds of workers/models/fused_decode.py
(`ROWS_ATTENTION_MAX_CONTEXT`, `BF16_TILES_MAX_CONTEXT`) come from these.

Prints the median of 10 timed rounds (after 2) per dtype (q / cache: the model's own, or the int8 cache
of kernels/kv_int8.py) and layout. To compare two versions of the
kernel, run this from each checkout in turn (the library is built per source, `kernels/cpu/native/build.py`).

    PYTHONPATH=. .venv/bin/python ops/bench/paged_decode.py [--batch 32 --context 380 --threads 2]
        [--against-sdpa 512,768,1024,1536,2048]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu import native
from kernels.kv_int8 import quantize

LAYERS, KV_HEADS, GROUP, HEAD_DIM, BLOCK = 30, 3, 3, 64, 8


def cache(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return quantize(values) if dtype == torch.int8 else values.to(dtype)


def time_layout(dtype: torch.dtype, cache_dtype: torch.dtype, batch: int, context: int, layout: str) -> float:
    contexts = [context] * batch
    if layout == "uneven":
        contexts = [round(context * (1.8 if i < batch // 2 else 0.2)) for i in range(batch)]
    per_seq = (max(contexts) + BLOCK - 1) // BLOCK
    num_blocks = batch * per_seq + 8
    distinct = 1 if layout == "warm" else LAYERS
    keys = [cache(num_blocks, cache_dtype) for _ in range(distinct)]
    values = [cache(num_blocks, cache_dtype) for _ in range(distinct)]
    ids = list(range(num_blocks))
    if layout != "contiguous":
        random.Random(0).shuffle(ids)
    tables = torch.tensor([ids[i * per_seq:(i + 1) * per_seq] for i in range(batch)], dtype=torch.int32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    return layers_ms(q, keys, values, tables, lens, rounds=12)


def median_ms(call: Callable[[], object], rounds: int) -> float:
    """Median ms of `call()` over `rounds` rounds, the first 2 dropped."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def layers_ms(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], tables: torch.Tensor,
              lens: torch.Tensor, rounds: int) -> float:
    """Median ms of one pass over LAYERS layers (layer i reads cache i mod len(keys)), the first 2 rounds dropped."""

    def layers() -> None:
        for layer in range(LAYERS):
            torch.ops.tollway_cpu.paged_decode(q, keys[layer % len(keys)], values[layer % len(keys)], tables, lens,
                                               HEAD_DIM ** -0.5, 0)

    return median_ms(layers, rounds)


def time_prefill(dtype: torch.dtype, cache_dtype: torch.dtype, prompts: int, prompt: int, rows: int) -> float:
    """30 layers' attention of `rows` prefill rows: `prompts` prompts of `prompt` tokens, row by row."""
    per_seq = (prompt + BLOCK - 1) // BLOCK
    num_blocks = prompts * per_seq + 8
    keys = [cache(num_blocks, cache_dtype) for _ in range(LAYERS)]
    values = [cache(num_blocks, cache_dtype) for _ in range(LAYERS)]
    ids = list(range(num_blocks))
    random.Random(1).shuffle(ids)
    spans = [(ids[i * per_seq:(i + 1) * per_seq], position) for i in range(prompts) for position in range(prompt)]
    tables = torch.tensor([table for table, _ in spans[:rows]], dtype=torch.int32)
    lens = torch.tensor([position + 1 for _, position in spans[:rows]], dtype=torch.int32)
    q = torch.randn(len(lens), KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    return layers_ms(q, keys, values, tables, lens, rounds=7)


def rows_against_sdpa(dtype: torch.dtype, length: int) -> tuple[float, float]:
    """(ms of `length` prefill rows of one sequence, ms of torch's causal SDPA on the same shapes), one layer."""
    per_seq = (length + BLOCK - 1) // BLOCK
    keys, values = cache(per_seq + 4, dtype), cache(per_seq + 4, dtype)
    ids = list(range(per_seq + 4))
    random.Random(2).shuffle(ids)
    tables = torch.tensor(ids[:per_seq], dtype=torch.int32).expand(length, -1).contiguous()
    lens = torch.arange(1, length + 1, dtype=torch.int32)
    q = torch.randn(length, KV_HEADS * GROUP, HEAD_DIM).to(dtype)
    rows = layers_ms(q, [keys], [values], tables, lens, rounds=9) / LAYERS
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    k4, v4 = (torch.randn(1, KV_HEADS, length, HEAD_DIM).to(dtype) for _ in range(2))
    sdpa = median_ms(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True), rounds=9)
    return rows, sdpa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=380)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against-sdpa", default="",
                        help="only this: lengths of one fresh sequence (comma-separated), rows against torch SDPA")
    args = parser.parse_args()
    if not native.load():
        raise SystemExit(f"the native kernels are not available here: {native.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    lengths = [int(length) for length in args.against_sdpa.split(",") if length]
    if lengths:  # only this comparison
        print(f"one fresh sequence, one layer, {args.threads} threads: prefill rows (tiles where they run) against "
              f"torch SDPA (causal); torch capability {torch.backends.cpu.get_cpu_capability()}")
        for dtype in (torch.bfloat16, torch.float32):
            for length in lengths:
                rows, sdpa = rows_against_sdpa(dtype, length)
                print(f"{str(dtype).removeprefix('torch.'):9} {length:5} tokens  rows {rows:6.2f} ms  "
                      f"SDPA {sdpa:6.2f} ms  SDPA / rows {sdpa / rows:4.2f}")
        return
    print(f"paged_decode, batch {args.batch} x {args.context} tokens, {LAYERS} layers, {args.threads} threads; "
          f"torch capability {torch.backends.cpu.get_cpu_capability()}")
    for dtype in (torch.bfloat16, torch.float32):
        for cache_dtype in (dtype, torch.int8):
            figures = "  ".join(f"{layout} {time_layout(dtype, cache_dtype, args.batch, args.context, layout):6.1f} ms"
                                for layout in ("scattered", "contiguous", "warm", "uneven"))
            name = f"{str(dtype).removeprefix('torch.')} / {str(cache_dtype).removeprefix('torch.')}"
            print(f"{name:18} {figures}")
    print("prefill rows, 30 layers")
    for dtype in (torch.bfloat16, torch.float32):
        for cache_dtype in (dtype, torch.int8):
            one = time_prefill(dtype, cache_dtype, 1, args.context, args.context)
            chunk_rows = min(1024, 3 * args.context)  # a CPU step's token budget, over three prompts
            chunk = time_prefill(dtype, cache_dtype, 3, args.context, chunk_rows)
            name = f"{str(dtype).removeprefix('torch.')} / {str(cache_dtype).removeprefix('torch.')}"
            print(f"{name:18} one {args.context}-token prompt {one:6.1f} ms  a {chunk_rows}-row chunk of three "
                  f"{chunk:6.1f} ms")


if __name__ == "__main__":
    main()
