"""A soak at a steady rate under real `tollway up` (one worker, the default model).

Open-loop arrivals at TOLLWAY_SOAK_RATE requests/s (`auto`: 70% of the capacity measured first,
closed loop, on the same mix) for TOLLWAY_SOAK_S seconds (default 120; 1800 for the table in
ops/RELIABILITY.md): streamed and non-streamed chats with short max_tokens, streams their client
cancels after the first chunk, half sharing a system prompt; beside them keys are created, used
and revoked every few seconds, and a small batch is submitted every minute (soak_traffic.py).

What must hold: no 5xx and no unexpected error; every admitted request has exactly one usage row,
and every batch line too; a revoked key is refused; gateway and worker RSS (VmRSS of the
supervisor's children) grow by at most 5% between the end of the warm-up and the end; no KV block
leaked; latency of the last window no worse than the first's. On runs of 15 minutes or more the windows
are 5 minutes and the last one's p99 is at most 1.2x the first's. On the short CI run the windows are thirds
of ~120 requests, whose p99 is their second-largest latency: one stall of the shared host fails it whatever
tollway does (CI, 2026-11-28: p50 173 ms, p99 254 ms in the first third and 953 ms in the last). There the
last third's p90 is at most 1.5x the first's + 50 ms: a slowdown of tollway's own (a growing structure, a
leak) moves the whole distribution and fails it; a stall of a second or two that catches a few requests
does not. The p99s are printed either way, and so is the host's steal time over the run."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from ops.bench.http_load import cpu_times, percentile
from tests.e2e.tollway_up import Tollway, child_pids, start_tollway
from tests.net import get_json
from tests.reliability.soak_traffic import BatchFeeder, KeyChurn, Outcome, one_request

pytestmark = [pytest.mark.reliability, pytest.mark.slow]
SOAK_S = float(os.environ.get("TOLLWAY_SOAK_S", "120"))
SOAK_RATE = os.environ.get("TOLLWAY_SOAK_RATE", "3")  # requests/s, or "auto" (70% of measured capacity)
RSS_GROWTH_BOUND = 0.05
WARMUP_S = 10
LONG_RUN_S = 900
WINDOW_S = 300


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def p99(values: list[float]) -> float:
    return percentile(values, 0.99)


def capacity(url: str, key: str, seconds: float = 30.0, clients: int = 16) -> float:
    """Requests/s of the same mix, closed loop."""
    done: list[Outcome] = []
    stop = time.monotonic() + seconds

    def client(c: int) -> None:
        i = 5_000_000 + c
        while time.monotonic() < stop:
            done.append(one_request(url, key, i, 0.0))
            i += clients

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(done) / (time.monotonic() - started)


def usage_rows(home: Path) -> dict[str, int]:
    engine = create_engine(f"sqlite:///{home / 'tollway.db'}")
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT request_id, count(*) FROM usage_events GROUP BY request_id")).all()
        lines = connection.execute(text("SELECT batch_id, count(*) FROM usage_events WHERE batch_id IS NOT NULL "
                                        "GROUP BY batch_id")).all()
    engine.dispose()
    return {**dict(rows), **{f"batch:{b}": n for b, n in lines}}


@pytest.fixture(scope="module")
def tollway(smollm2_folder: Path, model_home: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_tollway(tmp_path_factory.mktemp("soak") / "home", model_home, num_workers=1)
    yield running
    running.stop()


def test_soak_at_a_steady_rate(tollway: Tollway) -> None:
    key = tollway.new_key("soak")
    tollway.cli("tenants", "create", "churn")
    admin_key = (tollway.home / "admin.key").read_text().strip()
    rate = 0.7 * capacity(tollway.base_url, key) if SOAK_RATE == "auto" else float(SOAK_RATE)
    [gateway_pid] = child_pids(f"ops.cli gateway --port {tollway.port}")
    pids = {"gateway": gateway_pid, "worker": tollway.worker_pid(0)}
    total = int(SOAK_S * rate)
    results: list[Outcome] = []
    lock = threading.Lock()
    baseline: dict[str, float] = {}
    peak = {name: 0.0 for name in pids}
    churn = KeyChurn(tollway.base_url, admin_key, "churn")
    batches = BatchFeeder(tollway.base_url, key)
    side = [threading.Thread(target=churn.run, daemon=True), threading.Thread(target=batches.run, daemon=True)]

    def send(i: int, sent_at: float) -> None:
        outcome = one_request(tollway.base_url, key, i, sent_at)
        with lock:
            results.append(outcome)

    started, ticks_at_start = time.monotonic(), cpu_times()
    for thread in side:
        thread.start()
    with ThreadPoolExecutor(32) as pool:
        for i in range(total):
            due = started + i / rate
            time.sleep(max(0.0, due - time.monotonic()))
            pool.submit(send, i, due - started)
            if not baseline and time.monotonic() - started >= WARMUP_S:
                baseline = {name: rss_mb(pid) for name, pid in pids.items()}
            if i % max(1, int(rate * 5)) == 0:
                for name, pid in pids.items():
                    peak[name] = max(peak[name], rss_mb(pid))
    churn.stop()
    ended = batches.finish()
    elapsed = time.monotonic() - started
    steal = [end - begin for end, begin in zip(cpu_times(), ticks_at_start, strict=True)]
    final = {name: rss_mb(pid) for name, pid in pids.items()}
    assert [tollway.worker_pid(0), child_pids(f"ops.cli gateway --port {tollway.port}")] == \
        [pids["worker"], [pids["gateway"]]], "a child was restarted during the soak"

    everything = results + churn.outcomes
    server_errors = [o for o in everything if o.status >= 500]
    errors = [o.error for o in everything if o.error]
    assert len(results) == total
    assert not server_errors and not errors, f"{len(errors)} of {len(everything)} failed: {errors[:3]}"
    assert not churn.problems and churn.cycles > 0, churn.problems[:3]
    assert not batches.problems and all(b["status"] == "completed" for b in ended.values()) and \
        len(ended) == len(batches.batch_ids), (batches.problems[:3], ended)

    # Exactly one usage row per admitted request (the cancelled ones included) and per batch line.
    deadline = time.monotonic() + 30
    admitted = [o.request_id for o in everything if o.request_id]
    while True:  # one query per look (18,000 requests on the 30-minute run)
        rows = usage_rows(tollway.home)
        missing = [r for r in admitted if r not in rows]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    assert not missing, f"{len(missing)} admitted requests without a usage row"
    assert all(rows[r] == 1 for r in admitted)
    for batch_id, batch in ended.items():
        assert rows[f"batch:{batch_id}"] == batch["request_counts"]["completed"]

    growth = {name: (final[name] - baseline[name]) / baseline[name] for name in pids}
    info = get_json(f"http://127.0.0.1:{tollway.worker_port}/internal/info", tollway.worker_auth())
    blocks = info["blocks"]
    ordered = sorted(results, key=lambda o: o.sent_at)
    if SOAK_S >= LONG_RUN_S:
        first = [o.latency for o in ordered if o.sent_at < WINDOW_S]
        last = [o.latency for o in ordered if o.sent_at >= SOAK_S - WINDOW_S]
        check, statistic, bound = "p99", p99(last), 1.2 * p99(first)
    else:
        third = len(ordered) // 3
        first, last = [o.latency for o in ordered[:third]], [o.latency for o in ordered[-third:]]
        check, statistic, bound = "p90", percentile(last, 0.9), 1.5 * percentile(first, 0.9) + 0.05
    latencies = sorted(o.latency for o in results)
    # The figures first, so that a run failing one of the bounds below still reports them all.
    print(f"\nsoak {elapsed:.0f} s at {rate:.2f}/s: {total} requests + {churn.cycles} key cycles + "
          f"{sum(b['request_counts']['total'] for b in ended.values())} batch lines; 0 errors, 0 5xx; "
          f"usage rows = admitted requests ({len(admitted)}); p50 {latencies[len(latencies) // 2] * 1000:.0f} ms; "
          f"p90 first window {percentile(first, 0.9) * 1000:.0f} ms, last {percentile(last, 0.9) * 1000:.0f} ms; "
          f"p99 first window {p99(first) * 1000:.0f} ms, last {p99(last) * 1000:.0f} ms; "
          f"host steal {steal[0] / max(1, steal[1]):.1%}; RSS MB baseline→final "
          f"(peak): " + ", ".join(f"{n} {baseline[n]:.0f}→{final[n]:.0f} ({peak[n]:.0f}, {growth[n]:+.1%})"
                                  for n in pids) + f"; blocks {blocks}", flush=True)
    for name in pids:
        assert growth[name] <= RSS_GROWTH_BOUND, f"{name} RSS grew {growth[name]:.1%}"
    assert info["running"] == 0 and info["waiting"] == 0, info
    assert blocks["free"] + blocks["evictable"] == blocks["total"], f"KV blocks leaked: {blocks}"
    assert statistic <= bound, f"{check} of the last window {statistic:.3f} s > bound {bound:.3f} s"
