"""Variants of the engine's decode step compared in one process, step by step (issue 21): each variant is a set of
environment variables that the code under test reads on every call: a throw-away build's switch, or the shipped
`TOLLWAY_DECODE_DOTS` (read on every `paged_decode` call). A switch read once per process cannot be compared this way.

One engine (`decode_step.decoding_engine`: `--batch` unrelated prompts of `--context` tokens, greedy, on the
`--attention` backend) runs `--rounds` rounds of one step per variant. Each round's order is drawn at random: a
fixed alternation (A B, B A, A B, ...) read a switch that changes nothing as 0.23-0.28 ms a step faster on a
2-core Zen 5 (ops/bench/RESULTS.md, "The per-step A/B harness had a bias"). A `null` variant, the first variant's
variables plus `TOLLWAY_AB_NULL=1` (which nothing reads), runs beside them: its figure is the harness's noise.

Prints each variant's median step and, against the first variant, the median of the paired differences (the
same round's steps) and in how many rounds the variant was the faster. The contexts grow by one token a step
over the run (the range is printed); compare variants within one run only.

    PYTHONPATH=. .venv/bin/python ops/bench/step_ab.py base: fp32:MY_SWITCH=1 [--rounds 80] [--dtype auto]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import torch

from ops.bench.decode_step import cpu_flags, decoding_engine
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.precision import cpu_has_native_bf16

NULL_SWITCH = "TOLLWAY_AB_NULL"


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:VAR=VALUE,VAR=VALUE` (or `NAME:` for no variable) -> (NAME, {VAR: VALUE})."""
    name, sep, assignments = text.partition(":")
    if not name or not sep:
        raise argparse.ArgumentTypeError(f"a variant is NAME:VAR=VALUE[,VAR=VALUE], got {text!r}")
    env = {}
    for item in filter(None, assignments.split(",")):
        var, eq, value = item.partition("=")
        if not var or not eq:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def with_null(variants: list[tuple[str, dict[str, str]]]) -> list[tuple[str, dict[str, str]]]:
    """The variants and, last, `null`: the first variant's variables plus NULL_SWITCH."""
    names = [name for name, _ in variants]
    if len(set(names)) != len(names) or "null" in names:
        raise ValueError(f"variant names must be distinct and not 'null': {names}")
    return [*variants, ("null", {**variants[0][1], NULL_SWITCH: "1"})]


def round_orders(count: int, rounds: int, seed: int) -> list[list[int]]:
    """Each round's order of the `count` variants, drawn at random (seeded)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(range(count))
        rng.shuffle(order)
        orders.append(order)
    return orders


def paired_summary(times: list[list[float]]) -> list[tuple[float, float | None, int]]:
    """Per variant (times[v][round], seconds): its median, the median of its per-round differences from variant 0
    (None for variant 0) and the rounds where it was the faster of the two."""
    rows: list[tuple[float, float | None, int]] = []
    for v, own in enumerate(times):
        if v == 0:
            rows.append((statistics.median(own), None, 0))
            continue
        diffs = [a - b for a, b in zip(own, times[0], strict=True)]
        rows.append((statistics.median(own), statistics.median(diffs), sum(d < 0 for d in diffs)))
    return rows


def apply(env: dict[str, str], every: set[str]) -> None:
    """Set `env` in this process (C's getenv sees it), unsetting the other variants' variables."""
    for var in every - env.keys():
        os.environ.pop(var, None)
    os.environ.update(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", type=parse_variant, help="NAME:VAR=VALUE[,VAR=VALUE]; the first is "
                        "the baseline (NAME: for none)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="auto: bfloat16 where the CPU computes it natively, else float32")
    parser.add_argument("--attention", default="native", help="the engine's attention backend")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=380)
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    variants = with_null(args.variants)
    every = {var for _, env in variants for var in env}
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        args.dtype, torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    torch.set_num_threads(os.cpu_count() or 1)
    loaded = load_model(resolve_model_folder(args.model, args.home), dtype)
    steps = args.rounds * len(variants)
    engine = decoding_engine(loaded, args.batch, args.context, steps + 8, attention=args.attention)
    first = max(s.total_len for s in engine.sequences.values())
    times: list[list[float]] = [[] for _ in variants]
    for order in round_orders(len(variants), args.rounds, args.seed):
        for v in order:
            apply(variants[v][1], every)
            start = time.perf_counter()
            engine.step()
            times[v].append(time.perf_counter() - start)
    apply({}, every)
    print(f"{args.rounds} rounds of {len(variants)} steps in random order, batch {args.batch}, contexts "
          f"{first}-{first + steps}, {str(dtype).removeprefix('torch.')}, {args.attention}; CPU flags: {cpu_flags()}")
    for (name, env), (median, diff, faster) in zip(variants, paired_summary(times), strict=True):
        against = "baseline" if diff is None else (f"paired vs {variants[0][0]}: median {diff * 1e3:+.2f} ms, "
                                                   f"faster in {faster}/{args.rounds}")
        print(f"{name:12} median step {median * 1e3:7.2f} ms   {against}   {env or ''}", flush=True)


if __name__ == "__main__":
    main()
