"""What the gateway bench reads from /proc (ops/bench/http_load.py) and how its report judges issue 21's
gateway goals (ops/bench/gateway_overhead_report.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ops.bench.gateway_overhead_report import print_report
from ops.bench.http_load import RunResult, cpu_seconds, main_thread_cpu, voluntary_switches

pytestmark = pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task"), reason="needs Linux's /proc")


def test_a_helper_threads_cpu_counts_for_the_process_not_for_its_main_thread() -> None:
    pid = os.getpid()
    process_before, main_before = cpu_seconds(pid), main_thread_cpu(pid)

    def spin() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass

    helper = threading.Thread(target=spin)
    helper.start()
    helper.join()
    assert cpu_seconds(pid) - process_before >= 0.25  # whole clock ticks: 0.3 s reads as at least 0.25
    assert main_thread_cpu(pid) - main_before < 0.1


def test_every_wait_of_a_live_thread_is_a_voluntary_switch() -> None:
    pid = os.getpid()
    slept, done = threading.Event(), threading.Event()

    def nap() -> None:
        for _ in range(30):
            time.sleep(0.001)
        slept.set()
        done.wait()  # alive until counted: an ended thread's switches leave /proc/<pid>/task with it

    before = voluntary_switches(pid)
    helper = threading.Thread(target=nap)
    helper.start()
    try:
        assert slept.wait(5)
        assert voluntary_switches(pid) - before >= 30
    finally:
        done.set()
        helper.join()


def _run(target: str, concurrency: int, p50_ms: float, cpu_ms: float, loop_ms: float) -> RunResult:
    process = {"direct": "worker", "gateway": "gateway", "floor": "floor"}[target]
    return RunResult(target=target, concurrency=concurrency, stream=False, requests=1000, errors=0, seconds=5.0,
                     rps=1000.0, p50_ms=p50_ms, p99_ms=2 * p50_ms, ttfb_p50_ms=p50_ms,
                     cpu_ms_per_request={process: cpu_ms}, loop_cpu_ms_per_request={process: loop_ms},
                     switches_per_request={process: 2.5})


def test_the_report_judges_issue_21s_goals_and_splits_the_cpu_by_thread(capsys: pytest.CaptureFixture[str]) -> None:
    results = [_run("direct", 1, 0.60, 0.3, 0.3), _run("gateway", 1, 1.50, 1.1, 1.0), _run("floor", 1, 1.1, 0.5, 0.5),
               _run("direct", 64, 18.0, 0.2, 0.2), _run("gateway", 64, 40.0, 0.39, 0.30),
               _run("floor", 64, 19.0, 0.2, 0.2)]
    print_report(results, "test", cores=2, rate=None, tokens=8, token_delay_ms=0.0)
    out = capsys.readouterr().out
    assert "issue 21: added p50 at one client +0.90 ms (<= 1 ms: met)" in out
    assert "issue 21: gateway CPU a request at 64 clients 0.390 ms (<= 0.4 ms: met)" in out
    assert "C=64   gateway  event loop 0.300 + other threads 0.090 ms of CPU; 2.5 sleeps" in out
    assert "C=1    floor    event loop 0.500 + other threads 0.000 ms of CPU" in out

    slower = [_run("direct", 1, 0.60, 0.3, 0.3), _run("gateway", 1, 1.70, 1.1, 1.0),
              _run("direct", 64, 18.0, 0.2, 0.2), _run("gateway", 64, 40.0, 0.45, 0.30)]
    print_report(slower, "test", cores=2, rate=None, tokens=8, token_delay_ms=0.0)
    out = capsys.readouterr().out
    assert "+1.10 ms (<= 1 ms: NOT met)" in out and "0.450 ms (<= 0.4 ms: NOT met)" in out
