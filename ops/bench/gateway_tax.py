"""The gateway tax: the shared-prefix workload through the whole stack against the engine offline.

The workload is engine_gsp.py's generated shared prefix (G groups x P prompts of random token ids,
a system prompt shared within a group, O output tokens each, stop tokens ignored, all sent at
once). Each round runs it three ways, on the same token ids (a new seed per round, so no round
finds the previous one's prefixes cached):
  (a) offline: the engine in this process (`Engine.step()` until done), as engine_gsp.py does;
  (b) worker: a real `tollway worker` (`python -m ops.cli worker`, the model from --home), every
      prompt POSTed at once to its `/internal/generate`, streamed NDJSON;
  (c) gateway: a gateway in front of that worker (auth, in-process quotas, SQLite metering on),
      every prompt sent at once to `/v1/completions` as token ids, `stream: true` (SSE, with
      `stream_options.include_usage`), as an OpenAI client streams.
Output tok/s = output tokens / wall seconds from the first send to the last byte; tax = 1 - (b or
c) / (a). It also reports where the CPU went during (b) and (c): the CPU seconds of the worker's
event loop (its main thread), of its other threads (the engine's step loop and torch), of the
gateway and of this load generator (from /proc), and per output token.

    .venv/bin/python -m ops.bench.gateway_tax [--rounds 2] [--groups 4 --per-group 8 --system 350
        --question 30 --output 32] [--quantization none|int8|int4] [--threads N] [--home .tollway]

One stream (issue 22's single-stream workload): `--groups 1 --per-group 1 --system 20 --output 128`.

All processes share this machine's cores: on a 2-core host the gateway and the load generator
take CPU from the engine, which is part of the tax being measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import torch

from ops.bench.engine_gsp import run_engine, workload
from ops.bench.gateway_overhead import PathOptions, prepare_home
from ops.bench.http_load import (
    WORKER_AUTH,
    Service,
    child_env,
    cpu_seconds,
    free_port,
    main_thread_cpu,
    wait_healthy,
)
from workers.models.assets import resolve_model_folder
from workers.models.loader import load_model
from workers.precision import resolve_device, resolve_dtype

TIMEOUT = aiohttp.ClientTimeout(total=600)


async def worker_request(session: aiohttp.ClientSession, url: str, index: int, prompt: list[int],
                         output: int) -> int:
    body = {"request_id": f"tax-{secrets.token_hex(4)}-{index}", "namespace": "bench", "prompt_token_ids": prompt,
            "sampling": {"max_tokens": output, "temperature": 0.0, "ignore_eos": True}}
    async with session.post(f"{url}/internal/generate", json=body, headers=WORKER_AUTH) as response:
        response.raise_for_status()
        lines = [orjson.loads(line) for line in (await response.read()).splitlines() if line.strip()]
    return int(lines[-1]["usage"]["completion_tokens"])


async def gateway_request(session: aiohttp.ClientSession, url: str, key: str, model: str, prompt: list[int],
                          output: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    async with session.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        response.raise_for_status()
        async for raw in response.content:
            if raw.startswith(b"data: {") and b'"usage":{' in raw:
                usage = orjson.loads(raw[6:])["usage"]
    if usage is None:
        raise RuntimeError("the stream ended without usage")
    return int(usage["completion_tokens"])


async def timed(send: Any, prompts: list[list[int]]) -> tuple[float, int]:
    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(send(session, i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - start, sum(tokens)


def cpu_report(before: dict[str, float], after: dict[str, float], tokens: int) -> str:
    """Where the CPU went: the worker's event loop (its main thread: channel or HTTP, detokenized lines
    to frames), its other threads (the engine's step loop, torch), the gateway, the load generator."""
    spent = {name: after[name] - before[name] for name in after}
    parts = [f"worker loop {spent['worker_loop']:.2f}", f"engine threads {spent['worker'] - spent['worker_loop']:.2f}"]
    if "gateway" in spent:
        parts.append(f"gateway {spent['gateway']:.2f}")
    parts.append(f"load generator {spent['client']:.2f}")
    per_token = f"; per output token: worker loop {spent['worker_loop'] * 1e3 / tokens:.2f} ms"
    if "gateway" in spent:
        per_token += f", gateway {spent['gateway'] * 1e3 / tokens:.2f} ms"
    return "CPU s: " + ", ".join(parts) + per_token


async def online(args: argparse.Namespace, prompts_by_round: list[list[list[int]]]) -> list[dict[str, Any]]:
    home = Path(tempfile.mkdtemp(prefix="tollway-tax-"))
    services: list[Service] = []
    results: list[dict[str, Any]] = []
    try:
        key = prepare_home(home, PathOptions())
        worker_url, gateway_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        folder = resolve_model_folder(args.model, args.home)
        worker = Service("worker", ["-m", "ops.cli", "worker", "--model", str(folder), "--port",
                                    worker_url.rsplit(":", 1)[1], "--quantization", args.quantization], child_env(TOLLWAY_HOME=str(home), TOLLWAY_NUM_THREADS=str(args.threads)),
                         home / "worker.log")
        services.append(worker)
        gateway = Service("gateway", ["-m", "ops.cli", "gateway", "--port", gateway_url.rsplit(":", 1)[1]],
                          child_env(TOLLWAY_HOME=str(home), TOLLWAY_WORKER_URLS=worker_url,
                                    TOLLWAY_ADMIN_KEY="tw-admin-" + secrets.token_urlsafe(24)), home / "gateway.log")
        services.append(gateway)
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, worker, f"{worker_url}/healthz", lambda _: True)
            await wait_healthy(session, gateway, f"{gateway_url}/readyz", lambda body: body.get("status") == "ready")
            async with session.get(f"{worker_url}/internal/info", headers=WORKER_AUTH) as response:
                model = (await response.json())["model"]

        def snapshot(with_gateway: bool) -> dict[str, float]:
            snap = {"worker": cpu_seconds(worker.pid), "worker_loop": main_thread_cpu(worker.pid),
                    "client": cpu_seconds(os.getpid())}
            if with_gateway:
                snap["gateway"] = cpu_seconds(gateway.pid)
            return snap

        # Warm-up (compiles nothing, but the first requests pay lazy initialisations on both sides).
        await timed(lambda s, i, p: worker_request(s, worker_url, i, p, 4), prompts_by_round[0][:2])
        await timed(lambda s, i, p: gateway_request(s, gateway_url, key, model, p, 4), prompts_by_round[0][:2])
        for round_index, prompts in enumerate(prompts_by_round):
            for mode in ("worker", "gateway"):
                variant = [[(t + (mode == "gateway")) % 40000 + 100 for t in p] for p in prompts]  # never cached
                before = snapshot(mode == "gateway")
                if mode == "worker":
                    seconds, tokens = await timed(lambda s, i, p: worker_request(s, worker_url, i, p, args.output),
                                                  variant)
                else:
                    seconds, tokens = await timed(
                        lambda s, i, p: gateway_request(s, gateway_url, key, model, p, args.output), variant)
                after = snapshot(mode == "gateway")
                for service in services:
                    service.check_alive()
                results.append({"round": round_index, "mode": mode, "seconds": seconds, "tokens": tokens,
                                "cpu": cpu_report(before, after, tokens)})
                print(f"  round {round_index} {mode:8} {tokens / seconds:7.1f} out tok/s ({tokens} tokens in "
                      f"{seconds:.2f} s)  {results[-1]['cpu']}", flush=True)
    finally:
        for service in reversed(services):
            service.stop()
        shutil.rmtree(home, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("TOLLWAY_HOME", ".tollway")))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system", type=int, default=350)
    parser.add_argument("--question", type=int, default=30)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"),
                        help="the model's weights, offline and in the worker (TOLLWAY_QUANTIZATION)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of the engine, offline and in the worker (0 = every core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    device = resolve_device("auto")
    loaded = load_model(resolve_model_folder(args.model, args.home), resolve_dtype("auto", device), device,
                        quantization=args.quantization)
    rounds = [workload(True, args.groups, args.per_group, args.system, args.question, seed=100 + r)
              for r in range(args.rounds)]
    print(f"gateway tax: {len(rounds[0])} streamed requests at once, {args.groups} groups x {args.per_group}, "
          f"system {args.system} + question {args.question} tokens, {args.output} output tokens, weights "
          f"{args.quantization}; {args.rounds} rounds; "
          f"{os.cpu_count()} cores", flush=True)
    offline = []

    def run_offline(label: str) -> None:
        for r, prompts in enumerate(rounds):
            result = run_engine(loaded, prompts, args.output, "offline")
            offline.append(result.output_tokens / result.seconds)
            print(f"  round {r} offline  {offline[-1]:7.1f} out tok/s ({label})", flush=True)

    run_offline("before")
    results = asyncio.run(online(args, rounds))
    run_offline("after: the host's speed drifts")
    print()
    base = statistics.median(offline)
    print(f"offline engine (median of {len(offline)} runs, before and after): {base:.1f} out tok/s")
    for mode in ("worker", "gateway"):
        rates = [r["tokens"] / r["seconds"] for r in results if r["mode"] == mode]
        median = statistics.median(rates)
        print(f"{mode:8} median {median:7.1f} out tok/s = {median / base:.2f}x offline (tax {1 - median / base:+.1%}); "
              f"runs {', '.join(f'{x:.1f}' for x in rates)}")


if __name__ == "__main__":
    main()
