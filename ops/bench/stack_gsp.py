"""Whole stack vs llama-server and transformers on a shared-prefix chat workload (issue 21).

Workload (engine_gsp's, as text): G groups x P chat conversations; each group shares a system
prompt of ~S tokens of random vocabulary words (seeded), each conversation adds a ~Q-token user
question; max_tokens O with stop ignored (`ignore_eos`), so every system produces the same
output tokens (the table counts those actually returned). The no-sharing workload has the same
sizes with every system prompt unique. Each repetition draws fresh prompts (no cache carries
over), the same for every system, and runs the systems one after another; the table keeps each
system's best repetition.

Systems:
  - tollway stack: `tollway up` started here (gateway + engine worker, temp TOLLWAY_HOME), a
    tenant and key made with the CLI, the real `openai` AsyncOpenAI client, streamed, C in flight;
  - tollway engine offline: the same token ids (the gateway's chat template and tokenizer) on
    engine_gsp's Engine path in this process, C in flight, and all at once (engine_gsp's way);
  - llama-server (with --llama-server PATH): the model's GGUF, 4 slots, its OpenAI-compatible
    /v1/chat/completions, same client, streaming and concurrency;
  - transformers static batched `generate`, fp32 and bf16 (engine_gsp's functions, one batch).
In-process systems run on one background thread, as the worker runs its engine (torch ops from a
main thread spin in OpenMP waits: 10-20x slower on a loaded machine, measured here).

Columns: output tok/s (tokens actually returned / wall), TTFT p50 and p90 (request sent to its
first content chunk; transformers: the batch's prefill), wall (first request sent to last token),
and CPU s: the CPU time the serving processes used during the run (the stack's gateway + engine
worker, not the client nor the batch worker; llama-server; this process for in-process systems),
steadier than wall time on a loaded machine. HTTP systems' notes add the client's CPU time (this
process: the openai client shares the cores with the servers).

Goals (issue 21): stack / best of (transformers fp32, bf16, llama-server) >= 2.5x shared-prefix,
>= 1.5x no-sharing; stack / engine offline (C in flight) >= 0.9.

    .venv/bin/python ops/bench/stack_gsp.py [--llama-server PATH] [--home .tollway] [--repeats 2]
        [--groups 4 --per-group 8 --system 350 --question 30 --output 32 --in-flight 16] [--quick]

Build llama-server (bench only; never in CI, never committed): see ops/bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM

from ops.bench.engine_gsp import KV_BUDGET, run_engine, run_hf_static
from ops.bench.stack_servers import LlamaServer, TollwayStack, chat_load, processes_cpu_s, warm_up
from ops.bench.stack_workload import HEADER, Messages, Run, chat_workload, run_engine_in_flight
from workers.models.assets import BUILTIN_MODELS, resolve_model_folder
from workers.models.loader import LoadedModel, load_model
from workers.models.tokenizer import tokenizer_payload
from workers.precision import cpu_has_native_bf16, resolve_dtype
from workers.wire.tokenizer import TextTokenizer

STACK, OFFLINE, OFFLINE_ALL, LLAMA, HF32, HF16 = ("tollway stack", "tollway engine offline",
                                                 "tollway engine offline, all at once", "llama-server",
                                                 "transformers static fp32", "transformers static bf16")
WORKLOADS = ("shared-prefix", "no-sharing")
GOALS = {"shared-prefix": 2.5, "no-sharing": 1.5}
GOAL_STACK_VS_ENGINE = 0.9
QUICK = {"groups": 2, "per_group": 4, "system": 64, "question": 12, "output": 8, "in_flight": 4, "repeats": 1}


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} cores, flags: {' '.join(wanted)}"


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")),
                        help="a TOLLWAY_HOME whose models/ holds (or will hold, converted once) the model")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp llama-server binary")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF for llama-server (default: the model's)")
    parser.add_argument("--slots", type=int, default=4, help="llama-server -np")
    parser.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. '--poll 0'")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system", type=int, default=350)
    parser.add_argument("--question", type=int, default=30)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="repetitions (fresh prompts each); best kept")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--transformers-bf16", choices=("auto", "on", "off"), default="auto",
                        help="run transformers in bf16 too (auto: where the CPU computes bf16 natively)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run: " + str(QUICK))
    args = parser.parse_args()
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


class Bench:
    """Every system's runs, by workload; systems register a function of (workload, repetition)."""

    def __init__(self, args: argparse.Namespace, tokenizer: TextTokenizer) -> None:
        self.args = args
        self.runs: dict[str, dict[str, list[Run]]] = {w: {} for w in WORKLOADS}
        self.conversations: dict[tuple[str, int], list[Messages]] = {}
        self.prompt_ids: dict[tuple[str, int], list[list[int]]] = {}
        for rep in range(args.repeats):
            for i, workload in enumerate(WORKLOADS):
                conversations = chat_workload(tokenizer, workload == "shared-prefix", args.groups, args.per_group,
                                              args.system, args.question, seed=100 * rep + i)
                self.conversations[workload, rep] = conversations
                self.prompt_ids[workload, rep] = [tokenizer.encode_chat(c) for c in conversations]

    def record(self, workload: str, run: Run) -> None:
        self.runs[workload].setdefault(run.name, []).append(run)
        print(f"  {workload:13} {run.row()}", flush=True)

    def best(self, workload: str, name: str) -> Run | None:
        runs = self.runs[workload].get(name)
        return max(runs, key=lambda r: r.output_rate) if runs else None

    def report(self) -> None:
        for workload in WORKLOADS:
            print(f"\n{workload} workload (best of {self.args.repeats})\n{HEADER}")
            for runs in self.runs[workload].values():
                print(max(runs, key=lambda r: r.output_rate).row())
        print(f"\n{'ratio of output tok/s':56} " + " ".join(f"{w + ' (goal)':>22}" for w in WORKLOADS))
        for label, goal, ratio in self.ratios():
            cells = " ".join(f"{f'{r:.2f}x (>= {g:g}) ' + ('met' if r >= g else 'NOT met') if r else '—':>22}"
                             for r, g in zip(ratio, goal, strict=True))
            print(f"{label:56} {cells}")

    def ratios(self) -> list[tuple[str, list[float], list[float | None]]]:
        def ratio(workload: str, names: tuple[str, ...]) -> float | None:
            stack = self.best(workload, STACK)
            others = [r for r in (self.best(workload, n) for n in names) if r is not None]
            if stack is None or not others:
                return None
            return stack.output_rate / max(r.output_rate for r in others)

        anchors = (HF32, HF16, LLAMA)
        rows = [("stack / best of (transformers fp32, bf16, llama-server)", [GOALS[w] for w in WORKLOADS],
                 [ratio(w, anchors) for w in WORKLOADS])]
        for name in anchors:
            rows.append((f"stack / {name}", [GOALS[w] for w in WORKLOADS], [ratio(w, (name,)) for w in WORKLOADS]))
        rows.append((f"stack / engine offline ({self.args.in_flight} in flight)",
                     [GOAL_STACK_VS_ENGINE] * len(WORKLOADS), [ratio(w, (OFFLINE,)) for w in WORKLOADS]))
        return rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    folder = resolve_model_folder(args.model, args.home)
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(folder))
    bench = Bench(args, tokenizer)
    lengths = [len(ids) for ids in bench.prompt_ids["shared-prefix", 0]]
    print(f"whole-stack bench (issue 21): {cpu_line()}\n{load_line()} at start; {args.groups} groups x "
          f"{args.per_group} conversations, system ~{args.system} + question ~{args.question} tokens "
          f"(rendered prompts {min(lengths)}-{max(lengths)} tokens), max_tokens {args.output} (ignore_eos), "
          f"{args.in_flight} in flight, {args.repeats} repetition(s)", flush=True)
    dtype = resolve_dtype("auto", "cpu")
    ours = load_model(folder, dtype, "cpu")
    auto = cast(Any, AutoModelForCausalLM)  # transformers' decorator hides from_pretrained's signature
    hf_dtypes = [(HF32, torch.float32)]
    if args.transformers_bf16 == "on" or (args.transformers_bf16 == "auto" and cpu_has_native_bf16()):
        hf_dtypes.append((HF16, torch.bfloat16))
    else:  # bf16 is emulated there (5x slower than fp32 measured on an AVX2 host): never the best anchor
        print(f"{HF16}: skipped (--transformers-bf16 {args.transformers_bf16}; this CPU has no native bf16)")
    hf = {} if args.skip_transformers else {
        name: auto.from_pretrained(folder, dtype=dt).eval() for name, dt in hf_dtypes}
    print(f"engine offline dtype {str(dtype).removeprefix('torch.')} (auto); the stack's worker uses the same "
          f"default; torch threads {torch.get_num_threads()}", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="tollway-stack-bench-"))  # kept, with its logs, if a run fails
    stack = TollwayStack(workdir, args.home, {"TOLLWAY_KV_CACHE_MB": str(KV_BUDGET // 2**20)})
    llama = None
    if args.llama_server is not None:
        gguf = args.gguf or BUILTIN_MODELS[args.model].locate()
        if gguf is None:
            raise SystemExit("no GGUF for llama-server: pass --gguf")
        per_slot = 2 ** ((args.system + args.question + args.output + 64).bit_length() + 1)  # room to spare
        context = args.slots * per_slot
        llama = LlamaServer(args.llama_server, gguf, workdir, args.slots, context, shlex.split(args.llama_args),
                            args.in_flight)
        print(f"llama-server: {llama.version()}; {' '.join(llama.argv[1:])}", flush=True)
    else:
        print("llama-server: skipped (no --llama-server PATH; see ops/bench/README.md to build it)")
    try:
        key = stack.start()
        asyncio.run(warm_up(stack.base_url, key, args.output))
        if llama is not None:
            llama.start()
            asyncio.run(warm_up(llama.base_url, "none", args.output))
        print(f"tollway up ready at {stack.base_url} (logs {stack.home / 'logs'})\n"
              f"{STACK}: through the gateway, streamed, AsyncOpenAI, {args.in_flight} in flight; {OFFLINE}: "
              f"{args.in_flight} in flight; {LLAMA}: {args.slots} slots, {args.in_flight} in flight; "
              f"transformers: all in one batch\n\n{'':15} {HEADER}", flush=True)
        systems: list[tuple[str, Callable[[str, int], Any]]] = [
            (STACK, lambda w, r: asyncio.run(chat_load(
                stack.base_url, key, bench.conversations[w, r], args.output, args.in_flight,
                {"ignore_eos": True}))),
            (OFFLINE, lambda w, r: run_engine_in_flight(
                ours, bench.prompt_ids[w, r], args.output, args.in_flight, KV_BUDGET)),
            (OFFLINE_ALL, lambda w, r: run_engine(ours, bench.prompt_ids[w, r], args.output, OFFLINE_ALL)),
        ]
        if llama is not None:
            server = llama
            systems.append((LLAMA, lambda w, r: asyncio.run(chat_load(
                server.base_url, "none", bench.conversations[w, r], args.output, args.in_flight,
                {"ignore_eos": True}))))
        for name, model in hf.items():
            systems.append((name, hf_system(model, name, bench, args.output)))
        server_pids = {STACK: stack.server_pids(), LLAMA: [llama.process.pid] if llama and llama.process else []}
        # In-process systems run on one background thread, as the worker runs its engine: on a loaded
        # machine, torch ops from the main thread spin in OpenMP waits (10-20x slower measured here).
        engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-engine")
        engine_thread.submit(warm_up_in_process, ours, list(hf.values())).result()
        for rep in range(args.repeats):
            for workload in WORKLOADS:
                for name, run in systems:
                    pids = server_pids.get(name, [0])  # in-process systems: this process
                    cpu_before, client_before = processes_cpu_s(pids), processes_cpu_s([0])
                    if name in server_pids:
                        result = as_run(name, run(workload, rep))
                        result.note = f"client CPU {processes_cpu_s([0]) - client_before:.1f} s {result.note}"
                    else:
                        result = as_run(name, engine_thread.submit(run, workload, rep).result())
                    result.cpu_s = processes_cpu_s(pids) - cpu_before
                    bench.record(workload, result)
    except BaseException:
        print(f"failed: the servers' logs are kept in {workdir}", flush=True)
        raise
    finally:
        if llama is not None:
            llama.stop()
        stack.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    bench.report()
    print(f"\n{load_line()} at the end; {cpu_line()}")


def warm_up_in_process(loaded: LoadedModel, hf_models: list[Any]) -> None:
    """First-call costs (allocations, kernel selection) out of the figures, as the servers' warm-up does."""
    prompts = [list(range(100 + i, 140 + i)) for i in range(4)]
    run_engine_in_flight(loaded, prompts, 4, 4, KV_BUDGET)
    for model in hf_models:
        run_hf_static(model, prompts, 4, "warm-up")


def hf_system(model: Any, name: str, bench: Bench, output: int) -> Callable[[str, int], Any]:
    return lambda w, r: run_hf_static(model, bench.prompt_ids[w, r], output, name)


def as_run(name: str, result: Any) -> Run:
    """A Run named by its system (engine_gsp's Results converted)."""
    if isinstance(result, Run):
        return dataclasses.replace(result, name=name)
    note = f"prefix hit {result.hit_rate:.1%}" if result.hit_rate is not None else ""
    return Run(name, result.seconds, result.prompt_tokens, result.output_tokens, result.ttft, note)


if __name__ == "__main__":
    main()
