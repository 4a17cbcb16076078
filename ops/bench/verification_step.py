"""One speculative verification step on the CPU (issue 23): the same step timed three ways, interleaved
in one run so host load hits each alike. S sequences of the built-in model (fp32, native backend,
prepacked linears), each having computed a ~110-token chat prompt:
- plain decode: each runs its newest token (the fused native decode step);
- verify, fused: each runs its newest token + k drafted tokens as one-token decode rows (decode_rows.py);
- verify, extend: the same tokens as k + 1-token chunks through the eager path (before issue 23's fix).
Printed: median ms per step and the ratios to plain decode.

    PYTHONPATH=. .venv/bin/python ops/bench/verification_step.py [--home .tollway] [--seqs 1 4] [--k 4] [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from kernels.metadata import PagedAttentionMetadata
from workers.engine import decode_rows
from workers.models import fused_decode
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.models.packed_linear import pack_linears
from workers.paged_step import run_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    model = load_model(resolve_model_folder("smollm2-135m-instruct", args.home), torch.float32).model
    pack_linears(model)
    gen = torch.Generator().manual_seed(0)
    print(f"fp32, native backend, k={args.k}, torch threads {torch.get_num_threads()}, {args.reps} reps interleaved")
    print(f"{'seqs':>4} {'decode ms':>10} {'fused verify ms':>16} {'extend verify ms':>17} {'fused/decode':>13}"
          f" {'extend/decode':>14}")
    for seqs in args.seqs:
        block_size = 16
        pool = BlockPool(seqs * 10, block_size)
        kv = model.allocate_kv(pool.num_blocks, block_size)
        tables = [BlockTable(pool) for _ in range(seqs)]
        prompts = [torch.randint(3, 40000, (110,), generator=gen).tolist() for _ in range(seqs)]
        run_step(model, kv, tables, prompts, backend="native")
        computed = [t.num_tokens for t in tables]
        for t in tables:
            t.append(1 + args.k)  # room for the draft; every step below rewrites the same slots
        padded = PagedAttentionMetadata.build([1 + args.k] * seqs, [c + 1 + args.k for c in computed],
                                              [t.block_ids for t in tables], block_size, backend="native")
        # the eager layers (backend `cpu`: the same extend attention; `native` would now fuse the small ops)
        extend = PagedAttentionMetadata.build([1 + args.k] * seqs, [c + 1 + args.k for c in computed],
                                              [t.block_ids for t in tables], block_size, backend="cpu")
        rows = decode_rows.expand([1 + args.k] * seqs, computed, padded.block_tables, block_size, "native")
        plain = PagedAttentionMetadata.build([1] * seqs, [c + 1 for c in computed], [t.block_ids for t in tables],
                                             block_size, backend="native")
        assert fused_decode.can_fuse(model, rows) and fused_decode.can_fuse(model, plain)
        assert not fused_decode.can_fuse_layers(model, extend)
        tokens = torch.randint(3, 40000, (seqs * (1 + args.k),), generator=gen)
        cases = {"decode": (tokens[:seqs], plain, None), "fused": (tokens, rows, None), "extend": (tokens, extend, None)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for rep in range(args.reps + 2):
            for name, (ids, meta, _) in cases.items():
                start = time.perf_counter()
                model(ids, kv, meta)
                if rep >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"{seqs:>4} {med['decode']:10.1f} {med['fused']:16.1f} {med['extend']:17.1f} "
              f"{med['fused'] / med['decode']:12.2f}x {med['extend'] / med['decode']:13.2f}x")


if __name__ == "__main__":
    main()
