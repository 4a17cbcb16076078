"""The shared-prefix workload per weight format through the engine offline, interleaved (issue 22).

`quantization_stack.py` measures the issue's figure through the gateway, but there one format's runs
are minutes apart and the shared-prefix figure moved ±10-20% between repetitions on a 2-core host,
more than the differences it has to tell apart. Here every format's model lives in one process and
the rounds alternate (none, int8, int4, none, ...), each on a fresh engine (an empty prefix cache)
fed as the stack's clients feed a server (`run_engine_in_flight`: at most `--in-flight` requests,
the next added as one finishes), with the same token ids the gateway would send. Per round the
ratio to that round's `none`; the table gives each format's median tok/s and median ratio.

    PYTHONPATH=. .venv/bin/python ops/bench/quantization_shared.py --home .tollway [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from ops.bench.engine_gsp import KV_BUDGET
from ops.bench.quantization import cpu_flags
from ops.bench.stack_workload import chat_workload, run_engine_in_flight
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.models.tokenizer import tokenizer_payload
from workers.precision import resolve_dtype
from workers.wire.tokenizer import TextTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--formats", default="none,int8,int4", help="none first: the ratios' base")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system", type=int, default=350)
    parser.add_argument("--question", type=int, default=30)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    folder = resolve_model_folder(args.model, args.home)
    dtype = resolve_dtype(args.dtype)
    formats = args.formats.split(",")
    print(f"shared prefix {args.groups}x{args.per_group} (system ~{args.system}, question ~{args.question}, "
          f"{args.output} out, {args.in_flight} in flight), engine offline, {str(dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads; CPU flags: {cpu_flags()}; load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    models = {fmt: load_model(folder, dtype, quantization=fmt) for fmt in formats}
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(folder))
    prompts = [tokenizer.encode_chat(c) for c in chat_workload(tokenizer, True, args.groups, args.per_group,
                                                               args.system, args.question, seed=0)]
    run_engine_in_flight(models[formats[0]], prompts[:4], 4, 4, KV_BUDGET)  # warm-up (first-call costs)
    rates: dict[str, list[float]] = {fmt: [] for fmt in formats}
    ratios: dict[str, list[float]] = {fmt: [] for fmt in formats}
    for round_index in range(args.rounds):
        for fmt in formats:
            run = run_engine_in_flight(models[fmt], prompts, args.output, args.in_flight, KV_BUDGET, fmt)
            rates[fmt].append(run.output_rate)
            ratios[fmt].append(run.output_rate / rates[formats[0]][-1])
            print(f"  round {round_index + 1} {fmt:5} {run.output_rate:7.1f} out tok/s  x{formats[0]} "
                  f"{ratios[fmt][-1]:.3f}  {run.note}", flush=True)
    print(f"\n{'format':6} {'median tok/s':>12} {'median ratio':>12} {'ratios (each round)':>20}")
    for fmt in formats:
        each = " ".join(f"{r:.2f}" for r in ratios[fmt])
        print(f"{fmt:6} {statistics.median(rates[fmt]):12.1f} {statistics.median(ratios[fmt]):11.3f}x  {each}")
    print(f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")


if __name__ == "__main__":
    main()
