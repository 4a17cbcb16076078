"""A soak at a steady rate under real `tollway up` (one worker, the default model): open-loop
arrivals at SOAK_RATE requests/s for TOLLWAY_SOAK_S seconds (default 120; 600 for the table), a
mix of streamed and non-streamed chats with short max_tokens, some sharing a system prompt (so the
prefix cache is exercised) and some not. Traffic only to loopback, bounded in count
(rate × duration) and time (each request 60 s at most).

What must hold: error rate 0; gateway and worker RSS (VmRSS of the supervisor's children) grow by
less than RSS_BOUND_MB between the end of the warm-up and the end; no KV block leaked (the worker's
/internal/info afterwards: every block free or evictable cache, nothing running); p99 latency of the
last third at most 2× that of the first third (plus 50 ms for timer noise)."""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.e2e.tollway_up import Tollway, child_pids, start_tollway
from tests.net import get_json
from tests.reliability.stack import MODEL, headers

pytestmark = [pytest.mark.reliability, pytest.mark.slow]
SOAK_S = float(os.environ.get("TOLLWAY_SOAK_S", "120"))
SOAK_RATE = float(os.environ.get("TOLLWAY_SOAK_RATE", "3"))  # requests/s the 2-core machine sustains
RSS_BOUND_MB = {"gateway": 40, "worker": 80}
WARMUP_S = 10
SYSTEM = "You are a terse assistant for the soak test. Answer in one short sentence. " * 4


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def one_request(url: str, key: str, i: int) -> tuple[float, str | None]:
    rng = random.Random(i)
    messages = [{"role": "user", "content": f"Question {i}: what is {rng.randrange(1000)} plus {rng.randrange(1000)}?"}]
    if i % 2 == 0:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    stream = i % 3 == 0
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0.7, "seed": i, "stream": stream}
    started = time.perf_counter()
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, headers=headers(key), stream=stream,
                           timeout=60) as response:
            if response.status_code != 200:
                return time.perf_counter() - started, f"{response.status_code}: {response.text[:200]}"
            if stream:
                lines = [line for line in response.iter_lines() if line.startswith(b"data: ")]
                if lines[-1] != b"data: [DONE]" or any(b'"error"' in line for line in lines):
                    return time.perf_counter() - started, f"bad stream end: {lines[-2:]}"
            else:
                response.json()["choices"][0]["message"]
    except requests.RequestException as exc:
        return time.perf_counter() - started, repr(exc)
    return time.perf_counter() - started, None


@pytest.fixture(scope="module")
def tollway(smollm2_folder: Path, model_home: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_tollway(tmp_path_factory.mktemp("soak") / "home", model_home, num_workers=1)
    yield running
    running.stop()


def test_soak_at_a_steady_rate(tollway: Tollway) -> None:
    key = tollway.new_key("soak")
    [gateway_pid] = child_pids(f"ops.cli gateway --port {tollway.port}")
    pids = {"gateway": gateway_pid, "worker": tollway.worker_pid(0)}
    worker_url = f"http://127.0.0.1:{tollway.worker_port}"
    total = int(SOAK_S * SOAK_RATE)
    results: list[tuple[float, float, str | None]] = []  # (sent at, latency, error)
    lock = threading.Lock()
    baseline: dict[str, float] = {}
    peak = {name: 0.0 for name in pids}

    def send(i: int, sent_at: float) -> None:
        latency, error = one_request(tollway.base_url, key, i)
        with lock:
            results.append((sent_at, latency, error))

    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        for i in range(total):
            due = started + i / SOAK_RATE
            time.sleep(max(0.0, due - time.monotonic()))
            pool.submit(send, i, due - started)
            if not baseline and time.monotonic() - started >= WARMUP_S:
                baseline = {name: rss_mb(pid) for name, pid in pids.items()}
            if i % int(SOAK_RATE * 5) == 0:
                for name, pid in pids.items():
                    peak[name] = max(peak[name], rss_mb(pid))
    elapsed = time.monotonic() - started
    final = {name: rss_mb(pid) for name, pid in pids.items()}
    assert [tollway.worker_pid(0), child_pids(f"ops.cli gateway --port {tollway.port}")] == \
        [pids["worker"], [pids["gateway"]]], "a child was restarted during the soak"

    errors = [error for _, _, error in results if error]
    assert len(results) == total
    assert not errors, f"{len(errors)} of {total} failed: {errors[:3]}"
    growth = {name: final[name] - baseline[name] for name in pids}
    for name, bound in RSS_BOUND_MB.items():
        assert growth[name] < bound, f"{name} RSS grew {growth[name]:.1f} MB (bound {bound} MB)"

    info = get_json(f"{worker_url}/internal/info", tollway.worker_auth())
    blocks = info["blocks"]
    assert info["running"] == 0 and info["waiting"] == 0, info
    assert blocks["free"] + blocks["evictable"] == blocks["total"], f"KV blocks leaked: {blocks}"

    ordered = sorted(results)
    third = len(ordered) // 3
    first, last = [r[1] for r in ordered[:third]], [r[1] for r in ordered[-third:]]
    assert p99(last) <= 2 * p99(first) + 0.05, (p99(first), p99(last))
    print(f"\nsoak {elapsed:.0f} s at {SOAK_RATE}/s: {total} requests, 0 errors; p50 {sorted(r[1] for r in results)[total // 2] * 1000:.0f} ms; "
          f"p99 first third {p99(first) * 1000:.0f} ms, last third {p99(last) * 1000:.0f} ms; "
          f"RSS MB baseline→final (peak): " + ", ".join(
              f"{n} {baseline[n]:.0f}→{final[n]:.0f} ({peak[n]:.0f})" for n in pids)
          + f"; blocks {blocks}")
