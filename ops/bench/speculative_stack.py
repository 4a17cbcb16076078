"""Speculative decoding through the gateway (issue 23): `tollway up` with speculation off and with
the ngram drafter (TOLLWAY_SPECULATIVE=ngram), the workloads of ops/bench/speculative.py sent with
the real `openai` AsyncOpenAI client, streamed, temperature 0, stop tokens ignored (equal work).

Workloads (every request of a workload in flight at once):
- repetitive, 1 stream: one chat asking the model to repeat speculative.py's ~150-word PASSAGE;
  --output (128) tokens;
- repetitive, 4 streams: four such chats (speculative.py's ASKS) together;
- shared prefix GxP: stack_workload.py's chat workload (G groups x P conversations of random words,
  each group's system prompt ~S tokens, questions ~Q), --shared-output (32) tokens; fresh prompts
  each repetition (the same for both stacks), so nothing is copyable and drafts mostly miss.

Both stacks (ops/bench/stack_servers.py `TollwayStack`, fresh TOLLWAY_HOMEs) are started one after
the other, off then ngram, and kept up side by side; each repetition runs every workload on off then
on, so a change in the machine's load hits both; the table keeps each mode's best repetition. The
repetitive prompts are in both stacks' prefix caches after the warm-up (prefill is then ~nothing,
for both). Columns: output tok/s (completion tokens / first request sent to last token) off and
on, their ratio against the issue's goal, acceptance rate (accepted / drafted draft tokens) and mean
accepted length (accepted per verification), both from the ngram worker's /metrics counters
(`tollway_worker_speculative_*`) around the best repetition, and whether every text equalled off's.

    .venv/bin/python ops/bench/speculative_stack.py [--home .tollway] [--repeats 3] [--tokens 4] [--output 128]
        [--groups 2 --per-group 4 --system 350 --question 30 --shared-output 32] [--dtype auto] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from openai import AsyncOpenAI

from ops.bench.speculative import ASKS, PASSAGE
from ops.bench.stack_gsp import cpu_line, load_line
from ops.bench.stack_servers import Answer, TollwayStack, processes_cpu_s, stream_chat, warm_up
from ops.bench.stack_workload import Messages, chat_workload
from workers.models.assets import resolve_model_folder
from workers.models.tokenizer import tokenizer_payload
from workers.wire.tokenizer import TextTokenizer

MODEL = "smollm2-135m-instruct"
MODES = ("off", "ngram")
COUNTERS = ("drafted_tokens", "accepted_tokens", "verifications")
QUICK = {"repeats": 1, "output": 16, "groups": 1, "per_group": 2, "system": 64, "question": 12, "shared_output": 8}


@dataclass
class Measure:
    """One workload's pass on one stack: output tok/s, its texts, and the speculative counters' growth."""

    rate: float
    texts: list[str]
    counters: dict[str, float]

    @property
    def acceptance(self) -> float:
        return self.counters["accepted_tokens"] / self.counters["drafted_tokens"] if self.counters["drafted_tokens"] \
            else float("nan")

    @property
    def mean_length(self) -> float:
        return self.counters["accepted_tokens"] / self.counters["verifications"] if self.counters["verifications"] \
            else float("nan")


def counters(stack: TollwayStack) -> dict[str, float]:
    samples = stack.worker_metrics()
    return {name: samples.get(f"tollway_worker_speculative_{name}_total", 0.0) for name in COUNTERS}


async def all_at_once(base_url: str, key: str, conversations: list[Messages], max_tokens: int) -> list[Answer]:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=900.0)
    try:
        return await asyncio.gather(*(stream_chat(client, MODEL, c, max_tokens, {"ignore_eos": True})
                                      for c in conversations))
    finally:
        await client.close()


def measure(stack: TollwayStack, key: str, conversations: list[Messages], max_tokens: int) -> Measure:
    before = counters(stack)
    answers = asyncio.run(all_at_once(stack.base_url, key, conversations, max_tokens))
    after = counters(stack)
    wall = max(a.done for a in answers) - min(a.sent for a in answers)
    rate = sum(a.completion_tokens for a in answers) / wall
    return Measure(rate, [a.text for a in answers], {n: after[n] - before[n] for n in COUNTERS})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")),
                        help="a TOLLWAY_HOME whose models/ holds the converted model")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions; each mode's best kept")
    parser.add_argument("--tokens", type=int, default=4, help="TOLLWAY_SPECULATIVE_TOKENS (k)")
    parser.add_argument("--output", type=int, default=128, help="max_tokens of the repetitive workloads")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--system", type=int, default=350)
    parser.add_argument("--question", type=int, default=30)
    parser.add_argument("--shared-output", type=int, default=32, help="max_tokens of the shared-prefix workload")
    parser.add_argument("--dtype", default="auto", help="TOLLWAY_DTYPE of both workers")
    parser.add_argument("--quick", action="store_true", help="a small smoke run: " + str(QUICK))
    args = parser.parse_args()
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def main() -> None:
    args = parse_args()
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(resolve_model_folder(MODEL, args.home)))
    repetitive = [[{"role": "user", "content": f"{ask}\n\n{PASSAGE}"}] for ask in ASKS]
    shared = f"shared prefix {args.groups}x{args.per_group}"
    goals = {"repetitive, 1 stream": 1.8, "repetitive, 4 streams": 1.4, shared: 0.95}

    def workload(name: str, rep: int) -> tuple[list[Messages], int]:
        if name == shared:
            return chat_workload(tokenizer, True, args.groups, args.per_group, args.system, args.question,
                                 seed=rep), args.shared_output
        return repetitive[:1] if name == "repetitive, 1 stream" else repetitive, args.output

    print(f"speculative decoding through the gateway (issue 23): {cpu_line()}\n{load_line()} at start; "
          f"TOLLWAY_DTYPE={args.dtype}, k={args.tokens}, {args.repeats} repetition(s), streamed AsyncOpenAI, "
          f"every request of a workload at once, ignore_eos", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="tollway-spec-bench-"))  # kept, with its logs, if a run fails
    stacks: dict[str, TollwayStack] = {}
    best: dict[tuple[str, str], Measure] = {}
    identical: dict[str, bool] = dict.fromkeys(goals, True)
    idle_cpu = 0.0
    try:
        keys = {}
        for mode in MODES:
            stack = stacks[mode] = TollwayStack(workdir / mode, args.home, {
                "TOLLWAY_SPECULATIVE": mode, "TOLLWAY_SPECULATIVE_TOKENS": str(args.tokens),
                "TOLLWAY_DTYPE": args.dtype})
            keys[mode] = stack.start()
            asyncio.run(warm_up(stack.base_url, keys[mode], 8))
            asyncio.run(all_at_once(stack.base_url, keys[mode], repetitive, 8))  # the passage's prompts cached
        for rep in range(args.repeats):
            for name in goals:
                conversations, max_tokens = workload(name, rep)
                results = {}
                for mode in MODES:
                    other = stacks[MODES[1 - MODES.index(mode)]].server_pids()
                    idle_before = processes_cpu_s(other)
                    results[mode] = measure(stacks[mode], keys[mode], conversations, max_tokens)
                    idle_cpu += processes_cpu_s(other) - idle_before
                    if best.get((name, mode)) is None or results[mode].rate > best[name, mode].rate:
                        best[name, mode] = results[mode]
                identical[name] &= results["off"].texts == results["ngram"].texts
                on = results["ngram"]
                print(f"  rep {rep + 1} {name:24} off {results['off'].rate:7.1f}  on {on.rate:7.1f} tok/s  "
                      f"accept {on.acceptance:6.1%}  mean len {on.mean_length:5.2f}", flush=True)
        if any(counters(stacks["off"]).values()):
            raise RuntimeError("the off stack speculated")
    except BaseException:
        print(f"failed: the stacks' logs are kept in {workdir}", flush=True)
        raise
    finally:
        for stack in stacks.values():
            stack.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    report(goals, best, identical, args.repeats)
    print(f"\nCPU time of the idle stack during the other's runs: {idle_cpu:.1f} s in all\n"
          f"{load_line()} at the end; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")


def report(goals: dict[str, float], best: dict[tuple[str, str], Measure], identical: dict[str, bool],
           repeats: int) -> None:
    print(f"\nbest of {repeats}\n{'workload':24} {'off tok/s':>9} {'on tok/s':>9} {'on/off (goal)':>22} "
          f"{'accept':>7} {'mean len':>8} identical")
    for name, goal in goals.items():
        off, on = best[name, "off"], best[name, "ngram"]
        ratio = on.rate / off.rate
        verdict = f"{ratio:.2f}x (>= {goal:g}) {'met' if ratio >= goal else 'NOT met'}"
        print(f"{name:24} {off.rate:9.1f} {on.rate:9.1f} {verdict:>22} {on.acceptance:7.1%} "
              f"{on.mean_length:8.2f} {identical[name]}")


if __name__ == "__main__":
    main()
