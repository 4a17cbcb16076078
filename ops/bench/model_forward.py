"""Forward-pass throughput of our model against transformers on the same weights.

Prints, in one run: load time of the converted folder, prefill tokens/s (one 512-token prompt)
and decode tokens/s (batch 1 and 16) for both implementations in fp32 and bf16.

    .venv/bin/python ops/bench/model_forward.py [--model smollm2-135m-instruct] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from cache.kv_storage import KVStorage
from workers.engine.draft_model import cache_keyword
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.paged_step import run_step

PREFILL_LEN = 512
DECODE_PROMPT_LEN = 64
DECODE_STEPS = 32
BLOCK_SIZE = 16


def best_of_interleaved(ours_fn, hf_fn, repeats: int) -> tuple[float, float]:
    """Best seconds of each over `repeats` alternating runs (after a warm-up of each).

    Alternating and taking the minimum keeps a noisy, shared machine from favouring either side.
    Each fn returns the seconds it measured itself.
    """
    ours_fn(), hf_fn()
    ours_s, hf_s = [], []
    for _ in range(repeats):
        ours_s.append(ours_fn())
        hf_s.append(hf_fn())
    return min(ours_s), min(hf_s)


def fresh_paged_kv(model, batch: int, tokens_each: int) -> tuple[KVStorage, list[BlockTable]]:
    pool = BlockPool(batch * -(-tokens_each // BLOCK_SIZE), BLOCK_SIZE)
    return model.allocate_kv(pool.num_blocks, BLOCK_SIZE), [BlockTable(pool) for _ in range(batch)]


def ours_prefill(model, ids: torch.Tensor) -> float:
    """Seconds to prefill `ids` [B, T] into fresh paged KV, wanting the last token's logits."""
    start = time.perf_counter()
    kv, tables = fresh_paged_kv(model, ids.shape[0], ids.shape[1])
    run_step(model, kv, tables, ids.tolist())
    return time.perf_counter() - start


def ours_decode(model, ids: torch.Tensor) -> float:
    """Seconds of DECODE_STEPS greedy decode steps after prefilling `ids` (prefill not counted)."""
    kv, tables = fresh_paged_kv(model, ids.shape[0], ids.shape[1] + DECODE_STEPS)
    logits = run_step(model, kv, tables, ids.tolist())
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        tokens = logits.argmax(-1).tolist()
        logits = run_step(model, kv, tables, [[t] for t in tokens])
    return time.perf_counter() - start


@torch.inference_mode()
def hf_prefill(model, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(ids, **{cache_keyword(model): DynamicCache()}, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_decode(model, ids: torch.Tensor) -> float:
    cache_arg = {cache_keyword(model): DynamicCache()}  # the one cache every call below extends
    out = model(ids, **cache_arg, use_cache=True, logits_to_keep=1)
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        out = model(token, **cache_arg, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def measure(
    folder: Path, dtype: torch.dtype, prefill_ids: torch.Tensor, decode_ids: dict[int, torch.Tensor], repeats: int
) -> list[tuple[str, float, float]]:
    """(metric, ours tokens/s, transformers tokens/s) rows for one dtype."""
    ours = load_model(folder, dtype).model
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    ours_t, hf_t = best_of_interleaved(
        lambda: ours_prefill(ours, prefill_ids), lambda: hf_prefill(theirs, prefill_ids), repeats)
    rows = [("prefill tok/s", PREFILL_LEN / ours_t, PREFILL_LEN / hf_t)]
    for batch, ids in decode_ids.items():
        ours_t, hf_t = best_of_interleaved(
            lambda i=ids: ours_decode(ours, i), lambda i=ids: hf_decode(theirs, i), repeats)
        tokens = batch * DECODE_STEPS
        rows.append((f"decode tok/s (batch {batch})", tokens / ours_t, tokens / hf_t))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    folder = resolve_model_folder(args.model, args.home)

    start = time.perf_counter()
    load_model(folder, torch.float32)
    print(f"load of converted folder (weights + tokenizer, fp32): {time.perf_counter() - start:.2f} s")

    gen = torch.Generator().manual_seed(0)
    prefill_ids = torch.randint(100, 40000, (1, PREFILL_LEN), generator=gen)
    decode_ids = {b: torch.randint(100, 40000, (b, DECODE_PROMPT_LEN), generator=gen) for b in (1, 16)}

    print(f"\nthreads={torch.get_num_threads()}  prefill={PREFILL_LEN} tokens  decode={DECODE_STEPS} steps "
          f"after a {DECODE_PROMPT_LEN}-token prompt  (best of {args.repeats}, alternating)")
    print(f"{'dtype':9} {'metric':22} {'tollway':>10} {'transformers':>13} {'ratio':>7}")
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for metric, ours_v, hf_v in measure(folder, dtype, prefill_ids, decode_ids, args.repeats):
            print(f"{name:9} {metric:22} {ours_v:10.1f} {hf_v:13.1f} {ours_v / hf_v:6.2f}x", flush=True)

if __name__ == "__main__":
    main()
