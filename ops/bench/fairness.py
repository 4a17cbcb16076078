"""Tenant fairness under a flood (issue 25): the same workload with the scheduler's `fcfs` and `fair`
policies in one run, driving the Engine offline (as engine_gsp.py does) on a small KV cache, so
that the flood cannot all run at once.

Tenants: an aggressor keeps `--flood` long streams in flight (it floods first); a second
backlogged tenant keeps as many short-prompt streams in flight; a victim sends short requests one
after the other. Each run lasts `--steps` engine steps; both backlogged tenants are topped up after
every step. Reported per run: the victim's time to first token (p50, p90; seconds and engine
steps), the backlogged tenants' weighted service (input x1 + output x2, divided by the weight) and
its split, output tokens per second and tokens computed per second. First the victim alone on an
idle engine (its TTFT reference). With `--weighted` a last fair run gives the second tenant
weight 2 (its raw service should be twice the aggressor's).

    .venv/bin/python ops/bench/fairness.py [--model tiny] [--dtype auto] [--steps 1000 --kv-blocks 128 --flood 48 --weighted]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.engine.admission import POLICIES, Policy
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.fairness import W_IN, W_OUT
from workers.engine.request import Sequence
from workers.models.assets import resolve_model_folder
from workers.models.loader import LoadedModel, load_model
from workers.models.tiny import write_tiny_model_folder
from workers.precision import DEVICE_CHOICES, resolve_device, resolve_dtype
from workers.wire.sampling import SamplingParams

TINY = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 2048}
AGGRESSOR, OTHER, VICTIM = "tenant-aggressor", "tenant-backlogged", "tenant-victim"


@dataclass(frozen=True)
class Shape:
    prompt: int
    output: int


@dataclass
class Run:
    name: str
    seconds: float = 0.0
    steps: int = 0
    ttft_s: list[float] = field(default_factory=list)
    ttft_steps: list[int] = field(default_factory=list)
    service: dict[str, float] = field(default_factory=dict)  # weighted (divided by the weight)
    raw: dict[str, float] = field(default_factory=dict)  # input x W_IN + output x W_OUT
    output_tokens: int = 0
    computed_tokens: int = 0
    preemptions: int = 0
    censored: bool = False  # the last victim request had no token yet: its wait so far is counted

    def row(self) -> str:
        def pct(values: list, q: float) -> float:
            return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

        share = ""
        if self.service:
            a, b = self.service.get(AGGRESSOR, 0.0), self.service.get(OTHER, 0.0)
            ratio = self.raw.get(OTHER, 0.0) / self.raw[AGGRESSOR] if self.raw.get(AGGRESSOR) else float("nan")
            share = f"{a / (a + b):6.1%} / {b / (a + b):6.1%}  raw B/A {ratio:5.2f}"
        return (f"{self.name + ('*' if self.censored else ''):18} {len(self.ttft_s):3} {statistics.median(self.ttft_s):7.3f} {pct(self.ttft_s, 0.9):7.3f}"
                f" {statistics.median(self.ttft_steps):6.1f} {pct(self.ttft_steps, 0.9):5}"
                f" {self.output_tokens / self.seconds:8.1f} {self.computed_tokens / self.seconds:8.1f}"
                f" {self.computed_tokens / self.steps:6.1f} {self.seconds / self.steps * 1e3:6.0f}"
                f" {self.preemptions:5}  {share}")


HEADER = (f"{'run':18} {'n':>3} {'TTFT50':>7} {'TTFT90':>7} {'st50':>6} {'st90':>5} {'out/s':>8} {'comp/s':>8}"
          f" {'comp/st':>6} {'ms/st':>6} {'preem':>5}  weighted service aggressor / backlogged")


class Workload:
    def __init__(self, engine: Engine, seed: int) -> None:
        self.engine, self.rng = engine, random.Random(seed)
        self.ids = itertools.count()
        self.open: dict[str, list[Sequence]] = {AGGRESSOR: [], OTHER: [], VICTIM: []}
        self.step_of: dict[int, int] = {}  # id(victim seq) -> the step it arrived at

    def submit(self, tenant: str, shape: Shape, weight: float = 1.0) -> Sequence:
        vocab = self.engine.loaded.model.config.vocab_size
        low = 100 if vocab > 1000 else 3  # past the special tokens
        prompt = [self.rng.randrange(low, vocab) for _ in range(shape.prompt)]
        params = SamplingParams(max_tokens=shape.output, temperature=0.0, ignore_eos=True)
        seq = self.engine.add_request(f"{tenant}-{next(self.ids)}", prompt, params, tenant, weight=weight)
        self.open[tenant].append(seq)
        return seq

    def top_up(self, tenant: str, shape: Shape, in_flight: int, weight: float = 1.0) -> None:
        self.open[tenant] = [s for s in self.open[tenant] if not s.finished]
        while len(self.open[tenant]) < in_flight:
            self.submit(tenant, shape, weight)


def engine_for(loaded: LoadedModel, args: argparse.Namespace, policy: Policy) -> Engine:
    return Engine(loaded, EngineConfig(num_blocks=args.kv_blocks, max_batch_tokens=args.max_batch_tokens,
                                       scheduling=policy, max_running_per_tenant=args.tenant_cap))


def run(loaded: LoadedModel, args: argparse.Namespace, name: str, policy: Policy, flood: bool,
        other_weight: float = 1.0) -> Run:
    engine = engine_for(loaded, args, policy)
    work = Workload(engine, seed=1)
    long, short, victim = (Shape(args.flood_prompt, args.flood_output), Shape(args.short_prompt, args.short_output),
                           Shape(args.victim_prompt, args.victim_output))
    result = Run(name)
    victim_seq: Sequence | None = None
    first_seen: set[int] = set()
    start = time.perf_counter()
    for step in range(args.steps):
        if flood:
            work.top_up(AGGRESSOR, long, args.flood)
            work.top_up(OTHER, short, args.flood, other_weight)
        if victim_seq is None or victim_seq.finished:
            victim_seq = work.submit(VICTIM, victim)
            work.step_of[id(victim_seq)] = step
        engine.step()
        if victim_seq.first_token_time is not None and id(victim_seq) not in first_seen:
            first_seen.add(id(victim_seq))
            result.ttft_s.append(victim_seq.first_token_time - victim_seq.arrival_time)
            result.ttft_steps.append(step - work.step_of[id(victim_seq)] + 1)
    result.seconds, result.steps = time.perf_counter() - start, args.steps
    assert victim_seq is not None
    if victim_seq.first_token_time is None:  # still waiting at the end: count what it waited so far (a lower bound)
        result.ttft_s.append(time.monotonic() - victim_seq.arrival_time)
        result.ttft_steps.append(args.steps - work.step_of[id(victim_seq)])
        result.censored = True
    engine.check_integrity()
    tenants = engine.scheduler.vtc.tenants
    result.output_tokens = sum(t.output_tokens for t in tenants.values())
    result.computed_tokens = sum(t.input_tokens + t.output_tokens for t in tenants.values())
    result.preemptions = engine.scheduler.preemptions
    if flood:
        for tenant in (AGGRESSOR, OTHER):
            result.service[tenant] = engine.scheduler.vtc.weighted_service(tenant)
            result.raw[tenant] = tenants[tenant].input_tokens * W_IN + tenants[tenant].output_tokens * W_OUT
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a model name or folder; `tiny`: a random-weight 4-layer Llama (same scheduling, cheaper steps)")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the model's dtype (auto: bf16 where the CPU computes it faster than fp32)")
    parser.add_argument("--steps", type=int, default=1000, help="engine steps per flood run (the victim alone: 200)")
    parser.add_argument("--kv-blocks", type=int, default=128, help="KV blocks of 8 tokens (small: contended)")
    parser.add_argument("--max-batch-tokens", type=int, default=128)
    parser.add_argument("--flood", type=int, default=48, help="streams each backlogged tenant keeps in flight")
    parser.add_argument("--flood-prompt", type=int, default=64)
    parser.add_argument("--flood-output", type=int, default=128)
    parser.add_argument("--short-prompt", type=int, default=16)
    parser.add_argument("--short-output", type=int, default=32)
    parser.add_argument("--victim-prompt", type=int, default=16)
    parser.add_argument("--victim-output", type=int, default=4)
    parser.add_argument("--tenant-cap", type=int, default=0,
                        help="most running sequences per tenant (TOLLWAY_MAX_RUNNING_PER_TENANT; 0 = none)")
    parser.add_argument("--weighted", action="store_true", help="also a fair run with the second tenant at weight 2")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.model == "tiny":  # random weights, the real model's scheduling: for a machine too loaded for it
        folder = write_tiny_model_folder(Path(tempfile.mkdtemp()) / "tiny", "llama", seed=0, **TINY)
    else:
        folder = resolve_model_folder(args.model, args.home)
    loaded = load_model(folder, dtype, device)
    print(f"model={args.model}  device={device}  threads={torch.get_num_threads()}  dtype={str(dtype).removeprefix('torch.')}  "
          f"{args.steps} steps/run, {args.kv_blocks} KV blocks x 8 tokens, max batch tokens {args.max_batch_tokens}; "
          f"aggressor {args.flood} in flight ({args.flood_prompt}+{args.flood_output} tokens), backlogged "
          f"{args.flood} in flight ({args.short_prompt}+{args.short_output}), victim sequential "
          f"({args.victim_prompt}+{args.victim_output})")
    run(loaded, argparse.Namespace(**{**vars(args), "steps": 8}), "warm-up", "fair", False)
    print(HEADER)
    alone_steps = min(args.steps, 200)  # enough sequential requests for its TTFT figures
    runs = [run(loaded, argparse.Namespace(**{**vars(args), "steps": alone_steps}), "victim alone", "fair", False)]
    print(runs[-1].row(), flush=True)
    for policy in POLICIES:
        runs.append(run(loaded, args, f"flood {policy}", policy, True))
        print(runs[-1].row(), flush=True)
    if args.weighted:
        runs.append(run(loaded, args, "flood fair B w=2", "fair", True, other_weight=2.0))
        print(runs[-1].row(), flush=True)
    alone, fcfs, fair = (statistics.median(r.ttft_s) for r in runs[:3])
    print("* the victim's last request had no token when the run ended: its wait so far counts as its TTFT")
    print(f"\nvictim TTFT p50 / alone: fcfs {fcfs / alone:.1f}x, fair {fair / alone:.1f}x (goal <= 3x)")
    rate = {r.name: r.computed_tokens / r.seconds for r in runs}
    print(f"throughput (tokens computed/s) fair / fcfs: {rate['flood fair'] / rate['flood fcfs']:.2f} (goal >= 0.95)")


if __name__ == "__main__":
    main()
