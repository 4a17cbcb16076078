"""The engine's prefill against the bound that sends long extends to SDPA (issue 21): prompts of each
`--lengths` tokens prefilled through the engine (precision `auto`, native backend, 1,024-token steps, one output
token), once with `fused_decode.rows_attention_max_context` as this CPU picks it and once per `--bounds` value in
its place, alternating `--pairs` times in one process so host load hits every bound alike. Printed: prompt tokens
per second, best and median over the pairs, per length and bound.

Up to the bound every extending sequence attends as decode rows (tiles for runs) inside the fused native step;
past it the step's extends go to torch's flash SDPA (`native.extend_step`). Where the CPU has AMX, SDPA's bf16
blocks run on AMX tiles and the bound is 512; elsewhere a bf16 model over a bf16 cache keeps its vdpbf16ps tiles
up to 2,048 (`BF16_TILES_MAX_CONTEXT`). This bench shows whether a host agrees.

    PYTHONPATH=. .venv/bin/python ops/bench/prefill_bound.py [--home .tollway] [--lengths 395,600,1000,1500]
        [--bounds 512,2048] [--tokens 6000] [--pairs 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import torch

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models import fused_decode
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.precision import cpu_flags, resolve_dtype
from workers.wire.sampling import SamplingParams

CHOSEN = "chosen"


def prefill_rate(engine: Engine, prompts: list[list[int]], tag: str) -> float:
    """Prompt tokens per second of prefilling `prompts` (one output token each) until the engine is idle."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--lengths", default="395,600,1000,1500")
    parser.add_argument("--bounds", default="512,2048", help="bounds to run in place of the chosen one")
    parser.add_argument("--tokens", type=int, default=6000, help="prompt tokens per run (whole prompts)")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    loaded = load_model(resolve_model_folder(args.model, args.home), resolve_dtype("auto", "cpu"))
    engine = Engine(loaded, EngineConfig(max_batch_tokens=1024, kv_budget_bytes=2 * 2**30))
    chosen_bound = fused_decode.rows_attention_max_context(loaded.model, engine.runner.kv)
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    print(f"prefill, {loaded.model.dtype}, {torch.get_num_threads()} threads; CPU flags: "
          f"{' '.join(f for f in wanted if f in cpu_flags())}; the bound this CPU picks: {chosen_bound}")
    chosen = fused_decode.rows_attention_max_context
    bounds: dict[str, object] = {CHOSEN: chosen}
    bounds.update({b: (lambda model, kv, b=int(b): b) for b in args.bounds.split(",") if b})
    rng = random.Random(5)
    try:
        for length in (int(x) for x in args.lengths.split(",")):
            count = max(1, args.tokens // length)
            rates: dict[str, list[float]] = {name: [] for name in bounds}
            prefill_rate(engine, [[rng.randrange(100, 40000) for _ in range(length)]], "warm")
            for pair in range(args.pairs):
                for name, bound in bounds.items():
                    fused_decode.rows_attention_max_context = bound  # type: ignore[assignment]
                    prompts = [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]
                    rates[name].append(prefill_rate(engine, prompts, f"{length}-{pair}-{name}"))
            for name, values in rates.items():
                label = f"{name} ({chosen_bound})" if name == CHOSEN else f"bound {name}"
                print(f"{count:3d} x {length:5d} tokens  {label:14}  prompt tok/s best {max(values):7.0f}  "
                      f"median {statistics.median(values):7.0f}", flush=True)
    finally:
        fused_decode.rows_attention_max_context = chosen


if __name__ == "__main__":
    main()
