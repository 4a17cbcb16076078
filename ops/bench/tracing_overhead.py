"""Tracing overhead: p50 latency through the gateway with tracing off vs on (goal: ≤ 5% added).

Setup, all on 127.0.0.1: one fake engine worker (`ops/fake_worker.py`, 8 canned tokens, no model)
behind three gateway processes that differ only in tracing:
  off   the default (no TOLLWAY_TRACING, no OTLP endpoint): no spans, no middleware, no traceparent;
  ring  TOLLWAY_TRACING=1: every request traced into the in-process ring buffer (the dashboard's);
  otlp  TOLLWAY_OTLP_ENDPOINT pointing at a local OTLP/HTTP sink (its own process: this script
        with --sink), every request traced; spans are batched, encoded and sent by the gateway's
        exporter thread, as in production;
  otlp10  the same with TOLLWAY_TRACE_SAMPLE_RATIO=0.1 (as ops/deploy/compose.yaml sets).
Each round measures every mode once (closed loop, C clients, a 1 s warm-up then `--seconds`), the
modes alternating so the noise of this shared machine hits them alike; the best p50 of the rounds
is kept per mode. The fake worker does not trace, so this is the gateway's share (its spans, the
middleware, the traceparent header); the engine's phase spans cost a few span objects per request
and O(scheduled requests) per step only while tracing is on.

`--upstream engine` puts a real engine worker (`tollway worker`, the default model, tracing on
when its gateway's is) behind each of two gateways, off and ring: the added latency of tracing
relative to a request that generates (8 tokens), end to end including the engine's phase spans.

    .venv/bin/python ops/bench/tracing_overhead.py [--seconds 3] [--rounds 3] [--concurrency 1] [--stream]
        [--upstream fake|engine]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import aiohttp
from aiohttp import web

from ops.bench.gateway_overhead import (
    DEFAULT_TOKENS,
    PathOptions,
    gateway_request,
    prepare_home,
    sanity_check,
)
from ops.bench.http_load import (
    REPO_ROOT,
    WORKER_AUTH,
    RunResult,
    Service,
    child_env,
    closed_loop,
    free_port,
    wait_healthy,
)

GOAL_ADDED = 0.05
MODES = ("off", "ring", "otlp", "otlp10")
ENGINE_MODES = ("off", "ring")  # --upstream engine: one real worker per mode


def serve_otlp_sink(port: int) -> None:
    """Accepts OTLP/HTTP span exports and answers 200 (and counts them at /count)."""
    received: list[int] = []

    async def traces(request: web.Request) -> web.Response:
        received.append(len(await request.read()))
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def count(request: web.Request) -> web.Response:
        return web.json_response({"exports": len(received), "bytes": sum(received)})

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/count", count)
    app.router.add_get("/healthz", count)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def mode_env(mode: str, sink_port: int) -> dict[str, str]:
    if mode == "ring":
        return {"TOLLWAY_TRACING": "1"}
    if mode.startswith("otlp"):
        ratio = {"TOLLWAY_TRACE_SAMPLE_RATIO": "0.1"} if mode == "otlp10" else {}
        return {"TOLLWAY_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}", **ratio}
    return {}


def start_workers(args: argparse.Namespace, home: Path, modes: tuple[str, ...],
                  sink_port: int) -> dict[str, tuple[Service, str]]:
    """One fake worker shared by every gateway, or one real engine worker per mode."""
    if args.upstream == "fake":
        port = free_port()
        worker = Service("fake worker", ["-m", "ops.fake_worker", "--port", str(port)], child_env(), home / "worker.log")
        return dict.fromkeys(modes, (worker, f"http://127.0.0.1:{port}"))
    workers = {}
    for mode in modes:
        port = free_port()
        worker = Service(f"engine worker ({mode})", ["-m", "ops.cli", "worker", "--port", str(port)],
                         child_env(TOLLWAY_HOME=str(args.models_from), **mode_env(mode, sink_port)),
                         home / f"worker-{mode}.log")
        workers[mode] = (worker, f"http://127.0.0.1:{port}")
    return workers


async def run(args: argparse.Namespace, home: Path) -> dict[str, list[RunResult]]:
    key = prepare_home(home, PathOptions())
    sink_port = free_port()
    modes = MODES if args.upstream == "fake" else ENGINE_MODES
    services: list[Service] = []
    try:
        sink = Service("OTLP sink", [str(Path(__file__).resolve()), "--sink", str(sink_port)], child_env(),
                       home / "sink.log")
        services.append(sink)
        workers = start_workers(args, home, modes, sink_port)
        services.extend(dict.fromkeys(worker for worker, _ in workers.values()))
        gateways: dict[str, tuple[Service, str]] = {}
        admin = "tw-admin-" + secrets.token_urlsafe(24)
        for mode in modes:
            port = free_port()
            gateway = Service(f"gateway ({mode})", ["-m", "ops.cli", "gateway", "--port", str(port)],
                              child_env(TOLLWAY_HOME=str(home), TOLLWAY_WORKER_URLS=workers[mode][1],
                                        TOLLWAY_ADMIN_KEY=admin, **mode_env(mode, sink_port)),
                              home / f"gateway-{mode}.log")
            services.append(gateway)
            gateways[mode] = (gateway, f"http://127.0.0.1:{port}")
        async with aiohttp.ClientSession() as session:
            for worker, worker_url in dict.fromkeys(workers.values()):
                await wait_healthy(session, worker, f"{worker_url}/healthz", lambda _: True)
            await wait_healthy(session, sink, f"http://127.0.0.1:{sink_port}/healthz", lambda _: True)
            for mode, (gateway, url) in gateways.items():
                worker_url = workers[mode][1]
                await wait_healthy(session, gateway, f"{url}/healthz", lambda body: body.get("workers_healthy", 0) >= 1)
                async with session.get(f"{worker_url}/internal/info", headers=WORKER_AUTH) as response:
                    model = (await response.json())["model"]
                await sanity_check(session, worker_url, url, key, model, DEFAULT_TOKENS)
        print(f"{args.upstream} upstream; gateways: "
              + ", ".join(f"{m} pid {g.pid}" for m, (g, _) in gateways.items()), flush=True)
        results: dict[str, list[RunResult]] = {mode: [] for mode in modes}
        for round_number in range(args.rounds):
            for mode in modes if round_number % 2 == 0 else reversed(modes):
                gateway, url = gateways[mode]
                gateway.check_alive()
                send = gateway_request(url, key, model, stream=args.stream, tokens=DEFAULT_TOKENS)
                result = await closed_loop(mode, send, args.concurrency, args.seconds, args.stream,
                                           {"gateway": gateway.pid, "client": os.getpid()})
                results[mode].append(result)
                print(f"  round {round_number + 1} {mode:6} {result.rps:8,.0f} req/s  p50 {result.p50_ms:6.3f} ms  "
                      f"p99 {result.p99_ms:6.3f} ms  gateway CPU {result.cpu_ms_per_request['gateway']:.3f} ms/req  "
                      f"errors {result.errors}", flush=True)
        await asyncio.sleep(6)  # the OTLP exporter sends at least every 5 s
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{sink_port}/count") as answer:
            exported = await answer.json()
        print(f"OTLP sink received {exported['exports']} exports, {exported['bytes']:,} bytes", flush=True)
        return results
    finally:
        for service in reversed(services):
            service.stop()


def report(results: dict[str, list[RunResult]], args: argparse.Namespace) -> None:
    best = {mode: min(runs, key=lambda r: r.p50_ms) for mode, runs in results.items()}
    cpu = {mode: min(r.cpu_ms_per_request["gateway"] for r in runs) for mode, runs in results.items()}
    base = best["off"].p50_ms
    print()
    print(f"{'stream' if args.stream else 'non-streaming'} chat, max_tokens 8, C={args.concurrency}, {args.upstream} upstream, "
          f"best p50 of {args.rounds} rounds × {args.seconds:g} s")
    print(f"{'mode':7} {'p50 ms':>8} {'added':>8} {'p99 ms':>8} {'req/s':>8} {'gw CPU ms/req (min)':>20}")
    for mode in results:
        r = best[mode]
        print(f"{mode:7} {r.p50_ms:8.3f} {(r.p50_ms - base) / base * 100:+7.1f}% {r.p99_ms:8.3f} {r.rps:8,.0f} "
              f"{cpu[mode]:20.3f}")
    for mode in list(results)[1:]:
        added = (best[mode].p50_ms - base) / base
        print(f"goal ≤ {GOAL_ADDED:.0%} added p50 with tracing on ({mode}): "
              f"{'met' if added <= GOAL_ADDED else 'NOT met'} ({added:+.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run (after a 1 s warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each measures every mode once")
    parser.add_argument("--concurrency", type=int, default=1, help="closed-loop clients")
    parser.add_argument("--stream", action="store_true", help="stream=true (SSE) instead of plain JSON")
    parser.add_argument("--upstream", choices=["fake", "engine"], default="fake",
                        help="the fake worker (the gateway's share alone) or real engine workers (end to end)")
    parser.add_argument("--models-from", type=Path, default=REPO_ROOT / ".tollway",
                        help="TOLLWAY_HOME holding the converted default model (--upstream engine)")
    parser.add_argument("--sink", type=int, metavar="PORT", help=argparse.SUPPRESS)  # run as the OTLP sink
    args = parser.parse_args()
    if args.sink:
        serve_otlp_sink(args.sink)
        return
    home = Path(tempfile.mkdtemp(prefix="tollway-tracing-bench-"))
    try:
        results = asyncio.run(run(args, home))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    report(results, args)


if __name__ == "__main__":
    main()
