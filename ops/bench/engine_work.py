"""The engine's work on engine_gsp's shared-prefix workload, counted rather than timed.

Steps, cached prompt tokens, output tokens, Python function calls and the calls of each torch op
(cProfile) for one run of the workload: figures that do not move with the host's load, so two
trees can be compared on a busy machine where timings cannot (issue 19's before/after):

    cd <tree> && PYTHONPATH=$PWD /work/main/.venv/bin/python ops/bench/engine_work.py --home /abs/.tollway

Seconds are printed too, for the record only.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from ops.bench.engine_gsp import workload
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.precision import resolve_dtype
from workers.wire.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, default=Path(".tollway"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--top", type=int, default=12, help="torch ops listed, by calls")
    args = parser.parse_args()
    loaded = load_model(resolve_model_folder(args.model, args.home), resolve_dtype(args.dtype, "cpu"), "cpu")
    prompts = workload(True, 4, 8, 350, 30, 0)
    engine = Engine(loaded, EngineConfig(max_batch_tokens=1024, kv_budget_bytes=2 * 2**30))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    profile.disable()
    seconds = time.perf_counter() - start
    engine.check_integrity()
    stats = pstats.Stats(profile)
    print(f"steps {steps}; cached prompt tokens {sum(s.prompt_cached_len for s in seqs)}; "
          f"output tokens {sum(s.output_len for s in seqs)}; python calls {stats.total_calls}; "  # type: ignore[attr-defined]
          f"seconds {seconds:.2f} (not comparable under load)")
    torch_ops = [(calls, name) for (file, _, name), (_, calls, *_rest) in stats.stats.items()  # type: ignore[attr-defined]
                 if file == "~" and "torch" in name]
    for calls, name in sorted(torch_ops, reverse=True)[: args.top]:
        print(f"{calls:8d}  {name}")


if __name__ == "__main__":
    main()
