"""Gateway overhead: the latency the gateway adds over calling an engine worker directly, and its throughput.

Setup, all on 127.0.0.1: one fake engine worker (`python -m ops.fake_worker`, a test double that
answers `--tokens` canned tokens (8 by default) at once, or one every `--token-delay-ms` as an
engine's decode steps would; no model) and one gateway process (`python -m ops.cli gateway`)
in front of it, with a fresh SQLite database holding one tenant and one API key. Auth is on: every
gateway request carries the key (a cached lookup after the first). Quotas and metering are always
in the path; `PathOptions` chooses their stores (in-process / Redis, SQLite / another database).

For each concurrency level C (closed loop: C clients, each sending its next request as soon as the
last one ends; a 1 s warm-up, then `--seconds` measured), it measures
  (a) direct: `POST {worker}/internal/generate` with ~20 prompt token ids, max_tokens N, the whole
      NDJSON body read (`"stream": false`, the joined answer, as the gateway asks for a non-streamed
      request; the streaming variant streams);
  (b) gateway: `POST {gateway}/v1/chat/completions`, non-streaming, one short user message (numbered:
      each request's own), max_tokens N, the whole JSON body read;
and prints requests/s, p50/p99 latency of both, the added latency (gateway - direct at p50 and at
p99), and the gateway process's CPU time per request (utime + stime from /proc/<pid>/stat over the
measured window). Then a streaming variant at C = 1 (SSE, `stream: true`): time to first and to
last byte.

The gateway's auth cache (TTL 5 s by default) expires during every run, as it would in production.
No process of the setup has a garbage collection inside a measured window that it can avoid: the
load generator turns its collector off during each run, and the gateway and the fake worker freeze
their start-up heap (`ops.startup_heap`), so a full collection there is short.

On a small machine (e.g. 2 cores) the load generator, the gateway and the fake worker share the
cores, so the gateway's measured requests/s is a lower bound. The honest per-request cost is the
gateway's CPU time per request: 1 / cpu_s_per_request is what one core of gateway could serve.

Goals (issue): added p50 <= 2 ms, added p99 <= 10 ms, >= 1,500 non-streaming req/s per gateway
process. Anchor: LiteLLM proxy adds 30.6 ms p50 / 91.6 ms p99 at ~91 req/s per 4-vCPU pod.

    .venv/bin/python -m ops.bench.gateway_overhead [--seconds 5] [--concurrency 1,64,256] [--json [PATH]]
        [--no-stream] [--quotas] [--redis-url URL] [--database-url URL] [--rate R] [--pin-gateway]
        [--tokens N] [--token-delay-ms D] [--floor]

`--rate R` paces the C clients to R requests/s in all, for both direct and gateway runs: the added
latency at C clients then compares the two at the same offered load (below the gateway's capacity),
where the closed loop instead measures queueing behind whichever process saturates first.
`--floor` also runs each level through `ops.bench.relay_floor` (an aiohttp server relaying the same
requests over tollway's worker channel, and nothing else: the transport's share of the gateway's
cost). `--pin-gateway` gives the gateway a core of its own. `--tokens N --token-delay-ms D` make the fake
worker answer N tokens, one every D ms, as an engine's decode steps would.

To compare two checkouts, run it as a module from each (`cd CHECKOUT && .venv/bin/python -m
ops.bench.gateway_overhead ...`): run by path, its imports, and so the gateway and worker it
starts, come from wherever the venv's editable install points.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from accounting.api_keys import create_key
from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.tenants import create_tenant
from ops.bench.gateway_overhead_report import finite, print_report
from ops.bench.http_load import (
    WARMUP_S,
    WORKER_AUTH,
    Request,
    RunResult,
    Service,
    child_env,
    closed_loop,
    free_port,
    post_request,
    wait_healthy,
)

TENANT = f"bench-{secrets.token_hex(4)}"  # unique: a shared database may hold earlier runs
DEFAULT_TOKENS = 8  # the fake worker answers exactly max_tokens tokens
DIRECT_PROMPT_IDS = list(range(100, 120))  # ~ the ids of a short chat prompt
MESSAGES = [{"role": "user", "content": "Say hello."}]



@dataclass(frozen=True)
class PathOptions:
    """What sits in the gateway's request path during the run.

    Auth, quota admission/settlement and metering (one usage row per request, group-committed
    before the response's last byte) are always on. `quotas` gives the tenant finite, generous
    limits (never reached by this load) so every dimension is checked; `redis_url` moves the quota
    store from in-process to Redis; `database_url` moves accounting from SQLite to e.g. PostgreSQL.
    """

    quotas: bool = False
    redis_url: str | None = None
    database_url: str | None = None

    def tenant_quotas(self) -> dict[str, int]:
        if not self.quotas:
            return {}
        return {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6, "monthly_token_budget": 2**31 - 1}

    def gateway_env(self) -> dict[str, str]:
        env = {}
        if self.redis_url:
            env["TOLLWAY_REDIS_URL"] = self.redis_url
        if self.database_url:
            env["TOLLWAY_DATABASE_URL"] = self.database_url
        return env

    def note(self) -> str:
        quotas = "quotas (" + ("finite limits" if self.quotas else "unlimited tenant, usage still counted") + \
            f", {'Redis' if self.redis_url else 'in-process'} store)"
        metering = f"metering (group commit into {'the given database' if self.database_url else 'SQLite'})"
        return ("gateway path: auth (API key, cached lookup), validation, chat template + tokenization, "
                f"{quotas}, cache-aware routing, proxying, {metering}")


# --- processes -------------------------------------------------------------------------------


def prepare_home(home: Path, options: PathOptions) -> str:
    """Create the schema, one tenant and one key (in `home`/tollway.db unless a database is given);
    returns the key (plaintext). The tenant's name is unique, so a shared database can be reused."""
    engine = create_db_engine(options.database_url or f"sqlite:///{home / 'tollway.db'}")
    try:
        upgrade_database(engine)
        with session_factory(engine)() as session:
            create_tenant(session, TENANT, **options.tenant_quotas())
            _, key = create_key(session, TENANT, name="gateway-overhead bench")
            session.commit()
    finally:
        engine.dispose()
    return key


def direct_request(worker_url: str, stream: bool, tokens: int) -> Request:
    """What the gateway asks of the worker for the same call: the joined answer when not streamed."""
    ids = itertools.count()

    def body() -> bytes:
        return orjson.dumps({"request_id": f"bench-{next(ids)}", "namespace": "bench", "stream": stream,
                             "prompt_token_ids": DIRECT_PROMPT_IDS, "sampling": {"max_tokens": tokens}})

    return post_request(f"{worker_url}/internal/generate", body, {"Content-Type": "application/json", **WORKER_AUTH},
                        "worker")


def gateway_request(gateway_url: str, key: str, model: str, stream: bool, tokens: int) -> Request:
    """Each request's user message is its own (numbered), as users' are: nothing the gateway caches
    by prompt text (its tokenizer's pieces) sees a repeated message. The system prompt the model's
    chat template adds does repeat, as system prompts do."""
    numbers = itertools.count()

    def body() -> bytes:
        messages = [{"role": "user", "content": f"{MESSAGES[0]['content']} (request {next(numbers)})"}]
        return orjson.dumps({"model": model, "messages": messages, "max_tokens": tokens, "stream": stream,
                             "ignore_eos": True})  # exactly `tokens` from a real engine too

    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    return post_request(f"{gateway_url}/v1/chat/completions", body, headers, "gateway")


# --- main ------------------------------------------------------------------------------------


async def sanity_check(session: aiohttp.ClientSession, worker_url: str, gateway_url: str, key: str,
                       model: str, tokens: int) -> None:
    """One request each way, checked, before timing anything."""
    body = {"request_id": "bench-check", "namespace": "bench", "prompt_token_ids": DIRECT_PROMPT_IDS,
            "sampling": {"max_tokens": tokens, "ignore_eos": True}}
    async with session.post(f"{worker_url}/internal/generate", json=body, headers=WORKER_AUTH) as response:
        lines = [orjson.loads(line) for line in (await response.read()).splitlines() if line.strip()]
    if response.status != 200 or lines[-1].get("usage", {}).get("completion_tokens") != tokens:
        raise RuntimeError(f"unexpected direct answer ({response.status}): {lines[-1:]}")
    async with session.post(f"{gateway_url}/v1/chat/completions",
                            json={"model": model, "messages": MESSAGES, "max_tokens": tokens, "ignore_eos": True},
                            headers={"Authorization": f"Bearer {key}"}) as response:
        answer = await response.json()
    if response.status != 200 or answer.get("usage", {}).get("completion_tokens") != tokens:
        raise RuntimeError(f"unexpected gateway answer ({response.status}): {answer}")


async def run(args: argparse.Namespace, home: Path, options: PathOptions) -> list[RunResult]:
    key = prepare_home(home, options)
    worker_port, gateway_port = free_port(), free_port()
    worker_url, gateway_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{gateway_port}"
    services: list[Service] = []
    try:
        worker = Service("fake worker", ["-m", "ops.fake_worker", "--port", str(worker_port),
                                         "--delay-s", str(args.token_delay_ms / 1e3)],
                         child_env(), home / "worker.log")
        services.append(worker)
        gateway = Service("gateway", ["-m", "ops.cli", "gateway", "--port", str(gateway_port)],
                          child_env(TOLLWAY_HOME=str(home), TOLLWAY_WORKER_URLS=worker_url,
                                    TOLLWAY_ADMIN_KEY="tw-admin-" + secrets.token_urlsafe(24),
                                    TOLLWAY_HEALTH_INTERVAL_S="1", **options.gateway_env()),
                          home / "gateway.log")
        services.append(gateway)
        floor_port = free_port()
        floor, floor_url = None, f"http://127.0.0.1:{floor_port}"
        if args.floor:
            floor = Service("relay floor", ["-m", "ops.bench.relay_floor", "--port", str(floor_port),
                                            "--worker-url", worker_url], child_env(), home / "floor.log")
            services.append(floor)
        if args.pin_gateway:
            pin_gateway(gateway.pid, worker.pid)
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, worker, f"{worker_url}/healthz", lambda _: True)
            await wait_healthy(session, gateway, f"{gateway_url}/healthz",
                               lambda body: body.get("workers_healthy", 0) >= 1)
            async with session.get(f"{worker_url}/internal/info", headers=WORKER_AUTH) as response:
                model = (await response.json())["model"]
            await sanity_check(session, worker_url, gateway_url, key, model, args.tokens)
            if floor is not None:
                await wait_healthy(session, floor, f"{floor_url}/healthz", lambda _: True)
        print(f"fake worker pid {worker.pid} at {worker_url}; gateway pid {gateway.pid} at {gateway_url}; "
              f"model {model!r}; warm-up {WARMUP_S:g} s + {args.seconds:g} s per run", flush=True)

        pids = {"gateway": gateway.pid, "worker": worker.pid, "client": os.getpid(),
                **({"floor": floor.pid} if floor is not None else {})}
        plan: list[tuple[str, Request, int, bool]] = []
        for c in args.concurrency:
            plan.append(("direct", direct_request(worker_url, stream=False, tokens=args.tokens), c, False))
            plan.append(("gateway", gateway_request(gateway_url, key, model, stream=False, tokens=args.tokens), c,
                         False))
            if floor is not None:  # the same requests (the relay reads only max_tokens)
                plan.append(("floor", gateway_request(floor_url, key, model, stream=False, tokens=args.tokens), c,
                             False))
        if not args.no_stream:
            plan.append(("direct", direct_request(worker_url, stream=True, tokens=args.tokens), 1, True))
            plan.append(("gateway", gateway_request(gateway_url, key, model, stream=True, tokens=args.tokens), 1,
                         True))
        results = []
        for target, send, c, stream in plan:
            for service in services:
                service.check_alive()
            result = await closed_loop(target, send, c, args.seconds, stream, pids, rate=args.rate)
            results.append(result)
            print(f"  {target:8} C={c:<4}{' stream' if stream else '       '} {result.rps:9,.0f} req/s  "
                  f"p50 {result.p50_ms:7.2f} ms  p99 {result.p99_ms:7.2f} ms  errors {result.errors}", flush=True)
        return results
    finally:
        for service in reversed(services):
            service.stop()


def pin_gateway(gateway_pid: int, worker_pid: int) -> None:
    """The gateway on the last core alone; this load generator and the fake worker on the others, so
    the gateway's latency is not its wait for a core the load generator holds."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--pin-gateway needs at least 2 cores")
    os.sched_setaffinity(gateway_pid, {cores[-1]})
    for pid in (0, worker_pid):
        os.sched_setaffinity(pid, set(cores[:-1]))
    print(f"pinned: gateway on core {cores[-1]}, load generator and fake worker on {cores[:-1]}", flush=True)


def parse_levels(text: str) -> list[int]:
    levels = [int(part) for part in text.split(",") if part.strip()]
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError("give positive integers, e.g. 1,64,256")
    return levels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run (after a 1 s warm-up)")
    parser.add_argument("--concurrency", type=parse_levels, default=[1, 64, 256], help="closed-loop client counts")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="also dump the results as JSON (to stdout, or to PATH)")
    parser.add_argument("--no-stream", action="store_true", help="skip the streaming run at C=1")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="max_tokens of every request")
    parser.add_argument("--token-delay-ms", type=float, default=0.0,
                        help="the fake worker's time per token (an engine's decode step; default: all at once)")
    parser.add_argument("--pin-gateway", action="store_true",
                        help="run the gateway alone on the last core, everything else on the others")
    parser.add_argument("--rate", type=float, default=None,
                        help="pace the C clients to this many requests/s in all (default: closed loop)")
    parser.add_argument("--floor", action="store_true",
                        help="also run the same load through ops.bench.relay_floor (the transport alone)")
    parser.add_argument("--quotas", action="store_true",
                        help="give the tenant finite, generous quotas (every dimension checked)")
    parser.add_argument("--redis-url", default=None, help="quota store in this Redis (default: in-process)")
    parser.add_argument("--database-url", default=None,
                        help="accounting database (default: SQLite in a temp home); its schema is migrated")
    args = parser.parse_args()
    options = PathOptions(quotas=args.quotas, redis_url=args.redis_url, database_url=args.database_url)
    try:
        import uvloop  # optional: used only when installed (not a dependency)

        uvloop.install()
        loop_name = "uvloop"
    except ImportError:
        loop_name = "asyncio"
    cores = len(os.sched_getaffinity(0))
    print(f"gateway overhead benchmark: {cores} cores, client event loop {loop_name}; {options.note()}", flush=True)
    home = Path(tempfile.mkdtemp(prefix="tollway-bench-"))
    try:
        results = asyncio.run(run(args, home, options))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    summary = print_report(results, options.note(), cores, args.rate, args.tokens, args.token_delay_ms)
    text = json.dumps(finite(summary), indent=2)
    if args.json == "-":
        print(text)
    elif args.json:
        Path(args.json).write_text(text + "\n")
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
