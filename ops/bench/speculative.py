"""Speculative decoding (issue 23): the engine offline with the ngram drafter on vs off.

Workloads, each run off then on in the same process (after one warm-up run each):
- repetitive, 1 stream: a chat request asking the model to repeat a ~150-word passage; temperature
  0; 128 output tokens (stop tokens ignored, for equal work);
- repetitive, 4 streams: four such requests (different instructions) submitted together;
- shared prefix (ops/bench/engine_gsp.py `workload`): G groups x P prompts of random tokens sharing
  a system prompt; nothing to copy, so it shows what speculation costs when drafts miss.
Printed per workload and mode: output tok/s, speed-up, acceptance rate (accepted / drafted), mean
accepted length (accepted per verification), how many steps verified drafts on the fused native
decode step (as one-token rows, workers/engine/decode_rows.py) and how many steps the run took, and
whether the greedy tokens were identical; "timed off": the steps in which the speculation governor
(workers/engine/spec_governor.py) kept drafts off because steps with drafts measured slower.

    .venv/bin/python ops/bench/speculative.py [--home .tollway] [--device auto|cpu|cuda] [--tokens 4] [--output 128]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from ops.bench.engine_gsp import workload
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.assets import resolve_model_folder
from workers.models.loader import LoadedModel, load_model
from workers.models.tokenizer import tokenizer_payload
from workers.precision import DEVICE_CHOICES, resolve_device, resolve_dtype
from workers.wire.sampling import SamplingParams
from workers.wire.tokenizer import TextTokenizer

PASSAGE = (
    "Tollway is a self-hosted platform for serving language models to many tenants at once. A gateway "
    "receives each request, checks the caller's key and quota, and forwards the work to one of several "
    "engine workers. Every worker keeps the attention keys and values of its running requests in fixed "
    "size blocks, so memory is handed out a little at a time instead of being reserved for the longest "
    "possible answer. When two requests begin with the same system prompt, the second one finds those "
    "blocks in a prefix cache and skips the work of computing them again. The scheduler mixes new prompts "
    "with ongoing answers in every step, which keeps the machine busy without making anyone wait too long. "
    "Usage is counted per tenant, written to a database, and shown on a dashboard that operators can read "
    "at a glance. Batch jobs run in the background at a lower priority than interactive traffic."
)
ASKS = ["Repeat the following passage exactly, word for word.", "Copy this text without changing anything.",
        "Please write out the passage below again, unchanged.", "Reproduce the following paragraph verbatim."]


def run(loaded: LoadedModel, prompts: list[list[int]], output: int, mode: str, tokens: int,
        ) -> tuple[float, list[list[int]], dict[str, float | int]]:
    engine = Engine(loaded, EngineConfig(max_batch_tokens=1024, speculative=mode,  # type: ignore[arg-type]
                                         speculative_tokens=tokens))
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    steps = 0
    step = engine.step

    def counted() -> list:
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted  # type: ignore[method-assign]
    start = time.perf_counter()
    seqs = engine.generate_batch(prompts, params)
    seconds = time.perf_counter() - start
    engine.check_integrity()
    assert engine.all_blocks_free_or_evictable()
    governor = engine.spec_governor
    stats = {**engine.spec_stats.as_dict(), "fused_steps": engine.runner.fused_verifications, "steps": steps,
             "governed_off": governor.steps_off if governor is not None else 0}
    return sum(s.output_len for s in seqs) / seconds, [s.output_ids for s in seqs], stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    parser.add_argument("--tokens", type=int, default=4, help="draft tokens per step (k)")
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--per-group", type=int, default=4)
    args = parser.parse_args()
    device = resolve_device(args.device)
    folder = resolve_model_folder("smollm2-135m-instruct", args.home)
    loaded = load_model(folder, resolve_dtype("auto", device), device)
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(folder))
    chats = [tokenizer.encode_chat([{"role": "user", "content": f"{ask}\n\n{PASSAGE}"}]) for ask in ASKS]
    workloads = {
        "repetitive, 1 stream": (chats[:1], args.output),
        "repetitive, 4 streams": (chats, args.output),
        f"shared prefix {args.groups}x{args.per_group}": (
            workload(True, args.groups, args.per_group, 350, 30, seed=0), 32),
    }
    print(f"model {folder.name}  {loaded.model.dtype} on {device}  k={args.tokens}  torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'workload':28} {'off tok/s':>10} {'on tok/s':>10} {'speed-up':>9} {'accept':>7} {'mean len':>9}"
          f" {'fused/steps':>12} {'timed off':>9} identical")
    for name, (prompts, output) in workloads.items():
        for mode in ("off", "ngram"):  # warm-up
            run(loaded, prompts[:1], 8, mode, args.tokens)
        off_rate, off_ids, _ = run(loaded, prompts, output, "off", args.tokens)
        on_rate, on_ids, stats = run(loaded, prompts, output, "ngram", args.tokens)
        print(f"{name:28} {off_rate:10.1f} {on_rate:10.1f} {on_rate / off_rate:8.2f}x "
              f"{stats['acceptance_rate']:7.1%} {stats['mean_accepted_length']:9.2f} "
              f"{stats['fused_steps']:>5}/{stats['steps']:<6} {stats['governed_off']:>9} {on_ids == off_ids}")


if __name__ == "__main__":
    main()
