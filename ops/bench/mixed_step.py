"""A mixed step on the CPU (issue 21): decodes and a prefill chunk in one step, the way continuous
batching runs them while requests arrive. The same step timed two ways, interleaved in one run so host
load hits both alike, on the built-in model (precision `auto`, native backend, prepacked linears):
- eager: the model's eager layers (the native `paged_decode` for the decodes, the CPU extend path for
  the chunk; every small op a torch op), which every step with a prefill chunk ran before;
- fused: `fused_decode.step_hidden`, the native fused ops on every token.
S sequences decode at a ~380-token context beside one fresh prompt of P tokens. Printed: median ms per
step and fused / eager.

    PYTHONPATH=. .venv/bin/python ops/bench/mixed_step.py [--home .tollway] [--decodes 15] [--chunks 16 128 512]
        [--reps 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from kernels.metadata import PagedAttentionMetadata
from workers.models import fused_decode
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.models.packed_linear import pack_linears
from workers.paged_step import run_step
from workers.precision import resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--decodes", type=int, default=15)
    parser.add_argument("--context", type=int, default=380)
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    dtype = resolve_dtype("auto", "cpu")
    model = load_model(resolve_model_folder("smollm2-135m-instruct", args.home), dtype).model
    pack_linears(model)
    gen = torch.Generator().manual_seed(0)
    print(f"{dtype}, native backend, {args.decodes} decodes at context {args.context}, torch threads "
          f"{torch.get_num_threads()}, {args.reps} reps interleaved")
    print(f"{'chunk':>6} {'eager ms':>9} {'fused ms':>9} {'fused/eager':>12}")
    block_size = 16
    for chunk in args.chunks:
        pool = BlockPool(args.decodes * (args.context // block_size + 2) + chunk // block_size + 2, block_size)
        kv = model.allocate_kv(pool.num_blocks, block_size)
        tables = [BlockTable(pool) for _ in range(args.decodes)]
        contexts = [torch.randint(3, 40000, (args.context,), generator=gen).tolist() for _ in tables]
        run_step(model, kv, tables, contexts, backend="native")
        fresh = BlockTable(pool)
        for table in tables:
            table.append(1)  # every rep below rewrites the same slots
        fresh.append(chunk)
        order = [*tables, fresh]
        meta_args = ([1] * args.decodes + [chunk], [t.num_tokens for t in order], [t.block_ids for t in order])
        input_ids = torch.randint(3, 40000, (args.decodes + chunk,), generator=gen)
        last = torch.arange(args.decodes + 1) + torch.tensor([0] * args.decodes + [chunk - 1])
        times: dict[str, list[float]] = {"eager": [], "fused": []}
        for rep in range(args.reps + 2):
            for name in times:
                meta = PagedAttentionMetadata.build(*meta_args, block_size, backend="native")
                assert fused_decode.can_fuse_layers(model, meta)
                unfused = mock.patch.object(fused_decode, "can_fuse_layers", return_value=False)
                start = time.perf_counter()
                if name == "eager":
                    with unfused:
                        model(input_ids, kv, meta, last)
                else:
                    model(input_ids, kv, meta, last)
                if rep >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"{chunk:>6} {med['eager']:9.1f} {med['fused']:9.1f} {med['fused'] / med['eager']:11.2f}x")


if __name__ == "__main__":
    main()
