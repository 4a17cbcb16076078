"""The HTTP systems of the whole-stack bench (`stack_gsp.py`): a real `tollway up`, an optional
`llama-server`, and the load the real `openai` AsyncOpenAI client puts on either.

`TollwayStack` starts `python -m ops.cli up` from this checkout in a temp `TOLLWAY_HOME` whose
`models/` links to an existing home's converted models (no conversion), makes a tenant and an API
key with the CLI, reads its engine worker's /metrics (`worker_metrics()`), and stops the whole
process tree (SIGTERM to the supervisor) on `stop()`.
`LlamaServer` runs a llama.cpp `llama-server` binary on the same model's GGUF with N slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from ops.bench.http_load import REPO_ROOT, child_env, cpu_seconds, free_port
from ops.bench.stack_workload import Messages, Run

STARTUP_TIMEOUT_S = 300.0


def wait_for(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Until GET `url` answers 200; an error naming the log if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited ({process.returncode}); log: {log}\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s; log: {log}")


def stop_process(process: subprocess.Popen[bytes] | None, grace_s: float = 30.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class TollwayStack:
    """`tollway up` (gateway + one engine worker + the batch worker) on free ports."""

    def __init__(self, workdir: Path, model_home: Path, env: dict[str, str]) -> None:
        self.home = workdir / "tollway-home"
        self.home.mkdir(parents=True)
        (self.home / "models").symlink_to((model_home / "models").resolve(), target_is_directory=True)
        self.port, self.worker_port = free_port(), free_port()
        self.log = workdir / "tollway-up.log"
        self.env = child_env(TOLLWAY_HOME=str(self.home), **env)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker_metrics(self) -> dict[str, float]:
        """The engine worker's /metrics samples, by name (labels dropped: the last sample of a name wins)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.worker_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}

    def cli(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "ops.cli", *args], cwd=REPO_ROOT, env=self.env,
                              capture_output=True, text=True, check=False, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"tollway {' '.join(args)} failed: {done.stderr}")
        return done.stdout

    def start(self) -> str:
        """Start and wait for /readyz; returns a new tenant's API key."""
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ops.cli", "up", "--port", str(self.port), "--worker-port", str(self.worker_port)],
                cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        wait_for(f"{self.base_url}/readyz", self.process, self.log)
        self.cli("tenants", "create", "stack-bench")
        return self.cli("keys", "create", "--tenant", "stack-bench").strip()

    def server_pids(self) -> list[int]:
        """The gateway's and the engine worker's pids (children of the supervisor; not the batch worker)."""
        if self.process is None:
            return []
        return [pid for pid in children(self.process.pid) if " ops.cli " in cmdline(pid)]

    def stop(self) -> None:
        stop_process(self.process)


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.extend(int(p) for p in (task / "children").read_text().split())
    return found


def cmdline(pid: int) -> str:
    return " ".join(Path(f"/proc/{pid}/cmdline").read_text().split("\0"))


def processes_cpu_s(pids: list[int]) -> float:
    """utime + stime of these processes (0 for those gone); pid 0 is this process, client included."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid if pid else os.getpid())
    return total


class LlamaServer:
    """llama.cpp's `llama-server` with `slots` parallel slots sharing a `context`-token KV cache."""

    def __init__(self, binary: Path, gguf: Path, workdir: Path, slots: int, context: int,
                 extra: list[str] | None = None, in_flight: int = 16) -> None:
        self.port = free_port()
        self.log = workdir / "llama-server.log"
        self.argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-np", str(slots), "-c", str(context), "-t", str(os.cpu_count() or 1), "--jinja",
                     # an HTTP thread per open connection: with fewer, queued clients were disconnected
                     "--threads-http", str(in_flight + 4),
                     *(extra or [])]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def version(self) -> str:
        done = subprocess.run([self.argv[0], "--version"], capture_output=True, text=True, check=False, timeout=30)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
        return lines[0] if lines else "version unknown"

    def start(self) -> None:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for(f"{self.base_url}/health", self.process, self.log)

    def stop(self) -> None:
        stop_process(self.process)


@dataclass
class Answer:
    sent: float
    first_token: float | None
    done: float
    prompt_tokens: int
    completion_tokens: int
    usage_reported: bool
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    text: str = ""


async def stream_chat(client: AsyncOpenAI, model: str, messages: Messages, max_tokens: int,
                      extra_body: dict[str, Any]) -> Answer:
    """One streamed chat completion; the first token is the first chunk with content."""
    sent = time.perf_counter()
    first: float | None = None
    counted, usage, text = 0, None, []
    stream = await client.chat.completions.create(
        model=model, messages=cast(Any, messages), max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra_body)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                counted += 1
                text.append(choice.delta.content)
                if first is None:
                    first = time.perf_counter()
    done = time.perf_counter()
    if usage is None:
        return Answer(sent, first, done, 0, counted, False, text="".join(text))
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    return Answer(sent, first, done, usage.prompt_tokens, usage.completion_tokens, True, cached, "".join(text))


async def chat_load(base_url: str, api_key: str, conversations: list[Messages], max_tokens: int,
                    in_flight: int, extra_body: dict[str, Any], name: str = "") -> Run:
    """Every conversation, in order, `in_flight` at a time (each client sends its next request as
    soon as its last one ended), through one AsyncOpenAI client."""
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=2, timeout=900.0)
    try:
        model = (await client.models.list()).data[0].id
        queue = list(reversed(conversations))
        answers: list[Answer] = []

        async def worker() -> None:
            while queue:
                answers.append(await stream_chat(client, model, queue.pop(), max_tokens, extra_body))

        await asyncio.gather(*(worker() for _ in range(in_flight)))
    finally:
        await client.close()
    start, end = min(a.sent for a in answers), max(a.done for a in answers)
    missing = sum(a.first_token is None for a in answers)
    note = "" if all(a.usage_reported for a in answers) else "tokens counted from chunks (no usage)"
    if missing:
        note += f" {missing} answers without content"
    if all(a.cached_tokens is not None for a in answers):
        hit = sum(a.cached_tokens or 0 for a in answers) / max(1, sum(a.prompt_tokens for a in answers))
        note = f"prefix hit {hit:.1%} {note}"
    return Run(name, end - start, sum(a.prompt_tokens for a in answers), sum(a.completion_tokens for a in answers),
               [a.first_token - a.sent for a in answers if a.first_token is not None], note.strip())


async def warm_up(base_url: str, api_key: str, max_tokens: int) -> None:
    """A few short requests off the workload, so first-request costs stay out of the figures."""
    short: list[Messages] = [[{"role": "user", "content": f"Count to {i}."}] for i in range(3, 7)]
    await chat_load(base_url, api_key, short, max_tokens, 4, {"ignore_eos": True})
