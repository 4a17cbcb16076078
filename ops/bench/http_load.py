"""Closed-loop HTTP load for the benchmarks: child processes, clients, latency and CPU per request.

`closed_loop` runs C clients back to back (each sends its next request as soon as its last one
ended) for a warm-up and then a measured window, and reads the CPU time of the given processes
(from /proc) at the window's edges, so a result carries CPU ms per request as well as latency.
With `rate` it paces them instead: C clients together offer `rate` requests/s (client i sends at
its own staggered times, i/rate + k*C/rate; one that falls behind sends at once). Below the
target's capacity that measures the latency of a request at that concurrency, not queueing.
"""

from __future__ import annotations

import asyncio
import gc
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[2]
WARMUP_S = 1.0
STARTUP_TIMEOUT_S = 60.0
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=60)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def main_thread_cpu(pid: int) -> float:
    """CPU seconds of a process's main thread: a serving process's event loop, without its helper threads
    (the gateway's usage writer, thread pools)."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/task/{pid}/stat"))


def voluntary_switches(pid: int) -> int:
    """How many times the threads of a process gave up their CPU to wait (for a socket, a disk flush, a lock),
    from /proc/<pid>/task/*/status. Each is a sleep and a wakeup: a request that waits more often costs more.
    Only threads alive now count: one that ends between two readings takes its count with it."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        total += int(status.split("voluntary_ctxt_switches:", 1)[1].split(maxsplit=1)[0])
    return total


class ProcessReading(NamedTuple):
    """What `closed_loop` reads of a process at each edge of its measured window."""

    cpu_s: float
    loop_cpu_s: float  # its main thread's
    switches: int  # voluntary, of its live threads


def read_process(pid: int) -> ProcessReading:
    return ProcessReading(cpu_seconds(pid), main_thread_cpu(pid), voluntary_switches(pid))


def _stat_cpu_seconds(stat_path: Path) -> float:
    stat = stat_path.read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Service:
    """A child process whose output goes to a log file (shown when it dies)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, env=env,
                                        stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.name} exited with status {self.process.returncode}:\n{tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


WORKER_SECRET = secrets.token_urlsafe(24)
"""Every bench process's workers' secret (set by `child_env`); direct calls to a worker send `WORKER_AUTH`."""
WORKER_AUTH = {"Authorization": f"Bearer {WORKER_SECRET}"}


def child_env(**tollway: str) -> dict[str, str]:
    """This environment without any inherited TOLLWAY_* setting, plus the bench's worker secret and `tollway`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLWAY_")}
    env["TOLLWAY_WORKER_SECRET"] = WORKER_SECRET
    env.update(tollway)
    return env


async def wait_healthy(session: aiohttp.ClientSession, service: Service, url: str,
                       ready: Callable[[dict[str, Any]], bool]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        service.check_alive()
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                if response.status == 200 and ready(await response.json()):
                    return
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{service.name} not healthy at {url} after {STARTUP_TIMEOUT_S:.0f} s "
                               f"(log: {service.log_path})")
        await asyncio.sleep(0.1)


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of the whole machine, from /proc/stat: steal is the time the hypervisor
    ran someone else while this VM's CPUs wanted to run."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


@dataclass
class Sample:
    start: float
    end: float
    first_byte: float


Request = Callable[[aiohttp.ClientSession], Awaitable[float]]
"""Sends one request and reads the whole answer; returns when the first byte came (perf_counter)."""


def post_request(url: str, body: Callable[[], bytes], headers: dict[str, str], what: str) -> Request:
    """A Request that POSTs `body()` to `url` and reads the whole answer (a non-200 is an error)."""

    async def send(session: aiohttp.ClientSession) -> float:
        async with session.post(url, data=body(), headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(f"{what} answered {response.status}: {(await response.text())[:200]}")
            await response.content.readany()
            first = time.perf_counter()
            await response.content.read()
            return first

    return send


@dataclass
class RunResult:
    target: str
    concurrency: int
    stream: bool
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    ttfb_p50_ms: float
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)  # process name -> CPU ms / request
    loop_cpu_ms_per_request: dict[str, float] = field(default_factory=dict)  # the same, its main thread's alone
    switches_per_request: dict[str, float] = field(default_factory=dict)  # process name -> voluntary switches
    first_error: str | None = None
    steal_pct: float = float("nan")  # of the machine's CPU time during the window (noisy neighbours)


def per_request(amount: float, requests: int, scale: float = 1.0) -> float:
    """`amount` × `scale` per request (NaN when no request was measured)."""
    return amount * scale / requests if requests else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def closed_loop(target: str, send: Request, concurrency: int, seconds: float, stream: bool,
                      pids: dict[str, int], rate: float | None = None) -> RunResult:
    """C clients back to back (or paced to `rate` req/s in all) for WARMUP_S + `seconds`; only
    requests inside the measured window count."""
    connector = aiohttp.TCPConnector(limit=max(concurrency, 1), force_close=False)
    samples: list[Sample] = []
    errors: list[str] = []
    loop_start = time.perf_counter()
    window_start, window_end = loop_start + WARMUP_S, loop_start + WARMUP_S + seconds
    readings: dict[str, list[ProcessReading]] = {}  # process name -> its readings at the window's edges
    machine: list[tuple[int, int]] = []

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        next_send = loop_start + (index / rate if rate else 0.0)
        while True:
            if rate:
                await asyncio.sleep(max(0.0, next_send - time.perf_counter()))
                next_send += concurrency / rate
            if (start := time.perf_counter()) >= window_end:
                break
            try:
                first = await send(session)
            except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
                if start >= window_start:
                    errors.append(repr(exc))
                continue
            samples.append(Sample(start, time.perf_counter(), first))

    async def cpu_meter() -> None:
        # Read CPU times at the window's edges; includes the self process (the load generator).
        for edge in (window_start, window_end):
            await asyncio.sleep(max(0.0, edge - time.perf_counter()))
            for name, pid in pids.items():
                readings.setdefault(name, []).append(read_process(pid))
            machine.append(cpu_times())

    # The load generator's own garbage collections would stop every client at once (a full one took
    # 50-70 ms here) and land in whichever path's p99 is being measured: none during a run.
    gc.collect()
    gc.disable()
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT,
                                         auto_decompress=False) as session:
            await asyncio.gather(cpu_meter(), *(client(session, i) for i in range(concurrency)))
    finally:
        gc.enable()

    measured = [s for s in samples if s.start >= window_start and s.end <= window_end]
    latencies = [s.end - s.start for s in measured]
    ttfb = [s.first_byte - s.start for s in measured]
    n = len(measured)
    return RunResult(
        target=target, concurrency=concurrency, stream=stream, requests=n, errors=len(errors),
        seconds=seconds, rps=n / seconds, p50_ms=percentile(latencies, 0.5) * 1e3,
        p99_ms=percentile(latencies, 0.99) * 1e3, ttfb_p50_ms=percentile(ttfb, 0.5) * 1e3,
        cpu_ms_per_request={name: per_request(b.cpu_s - a.cpu_s, n, 1e3) for name, (a, b) in readings.items()},
        loop_cpu_ms_per_request={name: per_request(b.loop_cpu_s - a.loop_cpu_s, n, 1e3)
                                 for name, (a, b) in readings.items()},
        switches_per_request={name: per_request(b.switches - a.switches, n) for name, (a, b) in readings.items()},
        first_error=errors[0] if errors else None,
        steal_pct=(100.0 * (machine[1][0] - machine[0][0]) / max(1, machine[1][1] - machine[0][1])
                   if len(machine) == 2 else float("nan")),
    )
