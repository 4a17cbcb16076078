"""Batch jobs vs the same lines sent interactively: lines/s and tokens/s through `tollway up`.

Starts `tollway up` (gateway, one engine worker, the Celery batch worker on the embedded broker) in
a temporary home that borrows the converted models of `--models-from`, then runs the same N chat
lines (greedy, `ignore_eos`, so every line generates exactly `--max-tokens`) twice:

1. as one batch (upload, create, poll until completed); the runner keeps `--concurrency` lines in
   flight (TOLLWAY_BATCH_LINE_CONCURRENCY);
2. interactively: `--concurrency` closed-loop clients POSTing the lines to /v1/chat/completions.

Each run uses its own tenant, so neither finds the other's prompts in the prefix cache (the cache
is namespaced per tenant). Wall time of the batch counts from its creation to `completed` (it
includes queueing, polling at 0.5 s and writing the output file).

Interactive latency under a batch (the issue's "TTFT p50 within 2× of idle"): `--probes N` streamed
chat requests from a third tenant, one at a time, on the idle system first, then again and again
while the batch is in progress; the two TTFT p50s are printed with their ratio.

    .venv/bin/python ops/bench/batch.py --lines 1000            # the issue's size
    .venv/bin/python ops/bench/batch.py --lines 40 --max-tokens 4   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from ops.bench.http_load import REPO_ROOT, Service, child_env, free_port

MODEL = "smollm2-135m-instruct"
ENDED = ("completed", "failed", "expired", "cancelled")


def lines(count: int, max_tokens: int) -> list[dict[str, Any]]:
    return [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                      "messages": [{"role": "user", "content": f"Write a short note about the number {i}."}]}}
            for i in range(count)]


def cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "ops.cli", *args], env=env, capture_output=True, text=True,
                          check=True, cwd=REPO_ROOT)
    return done.stdout.strip()


async def wait_up(session: aiohttp.ClientSession, service: Service, url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        service.check_alive()
        try:
            async with session.get(f"{url}/healthz") as response:
                if response.status == 200 and (await response.json())["workers_healthy"] >= 1:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"tollway up not healthy within {timeout_s} s (log: {service.log_path})")


async def ttft_ms(session: aiohttp.ClientSession, url: str, key: str, i: int) -> float:
    """Time to the first streamed chunk of one short chat request (read to its end)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Probe {i}: name one colour."}],
            "max_tokens": 4, "temperature": 0, "stream": True}
    started = time.perf_counter()
    first: float | None = None
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as response:
        async for raw in response.content:
            if first is None and raw.startswith(b"data: "):
                first = (time.perf_counter() - started) * 1e3
    if first is None:
        raise RuntimeError(f"probe {i} got no chunk (HTTP {response.status})")
    return first


async def probe_while(session: aiohttp.ClientSession, url: str, key: str, running: asyncio.Event,
                      done: asyncio.Event) -> list[float]:
    """TTFTs of probes sent one after another from when `running` is set until `done` is."""
    await running.wait()
    samples: list[float] = []
    while not done.is_set():
        samples.append(await ttft_ms(session, url, key, 1000 + len(samples)))
        await asyncio.sleep(0.2)
    return samples


def p50(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2] if ordered else float("nan")


async def run_batch(session: aiohttp.ClientSession, url: str, key: str, requests: list[dict],
                    running: asyncio.Event | None = None) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {key}"}
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", "".join(json.dumps(r) + "\n" for r in requests).encode(), filename="bench.jsonl")
    async with session.post(f"{url}/v1/files", data=form, headers=auth) as response:
        file_id = (await response.json())["id"]
    started = time.perf_counter()
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    async with session.post(f"{url}/v1/batches", json=body, headers=auth) as response:
        batch = await response.json()
    while batch["status"] not in ENDED:
        if running is not None and batch["status"] == "in_progress":
            running.set()
        await asyncio.sleep(0.5)
        async with session.get(f"{url}/v1/batches/{batch['id']}", headers=auth) as response:
            batch = await response.json()
    elapsed = time.perf_counter() - started
    if batch["status"] != "completed" or batch["request_counts"]["failed"]:
        raise RuntimeError(f"the batch ended {batch['status']}: {batch['request_counts']}")
    usage = batch["usage"]
    return {"seconds": elapsed, "lines": batch["request_counts"]["completed"],
            "prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"]}


async def run_interactive(session: aiohttp.ClientSession, url: str, key: str, requests: list[dict],
                          concurrency: int) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {key}"}
    queue = iter(requests)
    totals = {"lines": 0, "prompt_tokens": 0, "completion_tokens": 0}

    async def client() -> None:
        for request in queue:
            async with session.post(f"{url}/v1/chat/completions", json=request["body"], headers=auth) as response:
                answer = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {answer}")
            totals["lines"] += 1
            totals["prompt_tokens"] += answer["usage"]["prompt_tokens"]
            totals["completion_tokens"] += answer["usage"]["completion_tokens"]

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"seconds": time.perf_counter() - started, **totals}


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{args.lines} lines, max_tokens {args.max_tokens} (ignore_eos), concurrency {args.concurrency}, "
          f"{os.cpu_count()} cores, dtype {args.dtype}")
    print(f"{'mode':<12} {'seconds':>8} {'lines/s':>8} {'out tok/s':>10} {'all tok/s':>10}")
    for mode, row in rows.items():
        if mode == "ttft":
            continue
        seconds = row["seconds"]
        row["lines_per_s"] = row["lines"] / seconds
        row["completion_tokens_per_s"] = row["completion_tokens"] / seconds
        row["total_tokens_per_s"] = (row["prompt_tokens"] + row["completion_tokens"]) / seconds
        print(f"{mode:<12} {seconds:>8.1f} {row['lines_per_s']:>8.2f} {row['completion_tokens_per_s']:>10.1f} "
              f"{row['total_tokens_per_s']:>10.1f}")
    if {"batch", "interactive"} <= rows.keys():
        ratio = rows["batch"]["lines_per_s"] / rows["interactive"]["lines_per_s"]
        print(f"batch / interactive throughput: {ratio:.2f}x")
    if "ttft" in rows:
        ttft = rows["ttft"]
        print(f"interactive TTFT p50: idle {ttft['idle_p50_ms']:.0f} ms ({len(ttft['idle_ms'])} probes), during the "
              f"batch {ttft['busy_p50_ms']:.0f} ms ({len(ttft['busy_ms'])} probes): "
              f"{ttft['busy_p50_ms'] / ttft['idle_p50_ms']:.2f}x (goal: at most 2x)")
    if args.json:
        print(json.dumps({"options": vars(args), "results": rows}, indent=2))


async def bench(args: argparse.Namespace, home: Path) -> dict[str, dict[str, Any]]:
    (home / "models").symlink_to(args.models_from.resolve() / "models", target_is_directory=True)
    port, worker_port = free_port(), free_port()
    env = child_env(TOLLWAY_HOME=str(home), TOLLWAY_DTYPE=args.dtype, TOLLWAY_KV_CACHE_MB="1024",
                    TOLLWAY_BATCH_LINE_CONCURRENCY=str(args.concurrency))
    up = Service("tollway up", ["-m", "ops.cli", "up", "--port", str(port), "--worker-port", str(worker_port)],
                 env, home / "up.log")
    url = f"http://127.0.0.1:{port}"
    requests = lines(args.lines, args.max_tokens)
    rows: dict[str, dict[str, Any]] = {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=3600)) as session:
            await wait_up(session, up, url)
            keys = {}
            for mode in ("batch", "interactive", "probe"):
                cli(env, "tenants", "create", f"bench-{mode}")
                keys[mode] = cli(env, "keys", "create", "--tenant", f"bench-{mode}")
            print(f"tollway up at {url}; running {args.lines} lines as a batch…", flush=True)
            idle = [await ttft_ms(session, url, keys["probe"], i) for i in range(args.probes)]
            running, done = asyncio.Event(), asyncio.Event()
            probes = asyncio.create_task(probe_while(session, url, keys["probe"], running, done)) if idle else None
            rows["batch"] = await run_batch(session, url, keys["batch"], requests, running)
            done.set()
            if probes is not None:
                busy = await probes
                rows["ttft"] = {"idle_ms": idle, "busy_ms": busy, "idle_p50_ms": p50(idle), "busy_p50_ms": p50(busy)}
            print("…and interactively", flush=True)
            rows["interactive"] = await run_interactive(session, url, keys["interactive"], requests, args.concurrency)
    finally:
        up.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16, help="batch lines in flight = interactive clients")
    parser.add_argument("--probes", type=int, default=10,
                        help="idle TTFT probes (then probes run all through the batch); 0 = none")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--models-from", type=Path, default=Path(os.environ.get("TOLLWAY_TEST_HOME", REPO_ROOT / ".tollway")),
                        help="a tollway home whose models/ holds the converted default model")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    if not (args.models_from / "models").is_dir():
        parser.error(f"{args.models_from}/models does not exist: run `tollway generate hi` once to convert the model")
    with tempfile.TemporaryDirectory(prefix="tollway-bench-batch-") as tmp:
        rows = asyncio.run(bench(args, Path(tmp)))
    report(rows, args)


if __name__ == "__main__":
    main()
