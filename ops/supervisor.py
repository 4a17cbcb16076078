"""`tollway up`: one supervisor process running the gateway, the engine workers and the batch worker.

Ownership: the supervisor owns its children. Each child is a `tollway` subcommand in its own
process with its output in `$TOLLWAY_HOME/logs/<name>.log`. A child that exits while the
supervisor runs is restarted after a backoff that doubles up to 30 s (reset once it has stayed up
for a minute). Ctrl-C / SIGTERM stops every child (SIGTERM, then SIGKILL after a grace period).

Before starting anything it migrates the database and loads (or creates, once) the admin key and
the workers' shared secret (`$TOLLWAY_HOME/worker.secret`, mode 600, unless TOLLWAY_WORKER_SECRET
is set), which it hands to its gateway and workers as TOLLWAY_WORKER_SECRET. It prints "tollway is
up" with the URL only once the gateway's `/readyz` answers 200 (an engine worker is in rotation; with
`--model`, one of every model), and a progress line every `PROGRESS_EVERY_S` until then.

Several models (`tollway up --model A --model B`, ops/served_models.py): each gets `--workers` engine
workers of its own; the gateway learns which worker serves which model from their `/internal/info`
and routes every request among the workers of its model (gateway/upstream/pool.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from ops.served_models import ServedModel, threads_per_worker, worker_layout

BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1
READY_POLL_S = 0.5
READY_PROBE_TIMEOUT_S = 2.0  # one GET /readyz
PROGRESS_EVERY_S = 10.0


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    backoff_s: float = field(default=1.0)

    def start(self) -> None:
        log = self.log_path.open("ab")
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
        log.flush()
        # A new session: a Ctrl-C in the terminal reaches the supervisor only, which stops children in order.
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=_die_with_parent)
        log.close()
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the supervisor dies, even by SIGKILL (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _tollway(*args: str) -> list[str]:
    return [sys.executable, "-m", "ops.cli", *args]


def plan_children(home: Path, port: int, num_workers: int, worker_port: int, worker_secret: str,
                  quantization: str | None = None, models: Sequence[ServedModel] = ()) -> list[Child]:
    """The children of `tollway up`; the gateway and the workers share `worker_secret`. Workers inherit
    the environment (every TOLLWAY_* setting, TOLLWAY_QUANTIZATION among them); `quantization` (from
    `tollway up --quantization`) overrides it. `num_workers` workers per model of `models` (ops/served_models.py),
    or of the default model when `models` is empty; all of them share the cores equally."""
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    slots = worker_layout(models, num_workers, worker_port)
    threads = threads_per_worker(len(slots), os.cpu_count() or 1)
    env = {**os.environ, "TOLLWAY_HOME": str(home)}
    secret = {"TOLLWAY_WORKER_SECRET": worker_secret}
    quantized = {"TOLLWAY_QUANTIZATION": quantization} if quantization is not None else {}
    urls = ",".join(f"http://127.0.0.1:{slot.port}" for slot in slots)
    children = [
        Child(f"worker-{slot.index}", _tollway("worker", "--port", str(slot.port), *_model_args(slot.model)),
              {**env, **secret, **quantized, "TOLLWAY_NUM_THREADS": env.get("TOLLWAY_NUM_THREADS", str(threads))},
              logs / f"worker-{slot.index}.log")
        for slot in slots
    ]
    children.append(Child("gateway", _tollway("gateway", "--port", str(port)),
                          {**env, **secret, "TOLLWAY_WORKER_URLS": urls}, logs / "gateway.log"))
    children.append(Child("batch-worker", batch_worker_argv(home, port),
                          {**env, "TOLLWAY_GATEWAY_URL": f"http://127.0.0.1:{port}"}, logs / "batch-worker.log"))
    return children


def _model_args(model: ServedModel | None) -> list[str]:
    """A worker's model flags: none for the default model (the worker reads TOLLWAY_MODEL itself)."""
    if model is None:
        return []
    served = ["--served-name", model.name] if model.name != model.source else []
    return ["--model", model.source, *served]


def batch_worker_argv(home: Path, port: int) -> list[str]:
    """The Celery worker of batch jobs: 2 threads (each runs one batch step, its lines concurrently
    through the gateway), with the beat sweep embedded (one worker: `-B` is safe here)."""
    return [sys.executable, "-m", "celery", "-A", "workers.jobs.app", "worker", "--pool", "threads",
            "--concurrency", "2", "--queues", "tollway.batches", "--beat",
            "--schedule-filename", str(home / "celerybeat-schedule"), "--loglevel", "INFO",
            "--hostname", f"tollway-{port}@%h", "--without-gossip", "--without-mingle"]


def readiness(url: str) -> tuple[bool, str]:
    """Whether the gateway's `/readyz` at `url` answers 200, and what is missing when it does not."""
    try:
        with urllib.request.urlopen(url, timeout=READY_PROBE_TIMEOUT_S) as response:
            return response.status == 200, "ready"
    except urllib.error.HTTPError as exc:  # 503: the gateway runs, no worker is in rotation yet
        try:
            body = json.loads(exc.read())
            state = f"{body['workers_healthy']} of {body['workers_total']} engine workers in rotation"
            missing = body.get("models_missing")
            return False, state + (f"; no worker of {', '.join(missing)} yet" if missing else "")
        except (ValueError, KeyError, TypeError):
            return False, f"the gateway answers {exc.code}"
    except (urllib.error.URLError, OSError):
        return False, "the gateway is not answering yet"


class Supervisor:
    def __init__(self, children: list[Child], console: Console) -> None:
        self.children = children
        self.console = console
        self.stopping = False

    def request_stop(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def _tend(self, child: Child) -> None:
        now = time.monotonic()
        if child.alive():
            if now - child.started_at > STABLE_AFTER_S:
                child.backoff_s = 1.0
            return
        if child.process is not None and child.next_start == 0.0:
            code = child.process.returncode
            self.console.print(f"[yellow]{child.name} exited with status {code}; restarting in "
                               f"{child.backoff_s:.0f} s[/] (log: {child.log_path})")
            child.next_start = now + child.backoff_s
            child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)
            return
        if now >= child.next_start:
            child.restarts += child.process is not None
            child.next_start = 0.0
            child.start()

    def wait_ready(self, ready_url: str, logs: Path) -> bool:
        """Tend the children until `/readyz` answers 200 (True) or a stop is asked for (False),
        printing what is still missing every PROGRESS_EVERY_S."""
        started = time.monotonic()
        next_progress = started + PROGRESS_EVERY_S
        with self.console.status("starting workers and gateway (the first start converts the model, ~20 s)…"):
            while not self.stopping:
                for child in self.children:
                    self._tend(child)
                ready, state = readiness(ready_url)
                if ready:
                    return True
                now = time.monotonic()
                if now >= next_progress:
                    self.console.print(f"still starting after {now - started:.0f} s: {state} (logs in {logs})")
                    next_progress = now + PROGRESS_EVERY_S
                time.sleep(READY_POLL_S)
        return False

    def run(self, ready_url: str, on_ready: str, logs: Path) -> int:
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGTERM, self.request_stop)
        for child in self.children:
            child.start()
        if self.wait_ready(ready_url, logs):
            self.console.print(on_ready)
        while not self.stopping:
            for child in self.children:
                self._tend(child)
            time.sleep(0.5)
        return self.shutdown()

    def shutdown(self) -> int:
        self.console.print("stopping…")
        for child in reversed(self.children):  # the gateway first: no new requests reach the workers
            child.stop()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        self.console.print("stopped.")
        return 0


def ready_url(port: int, models: Sequence[ServedModel] = ()) -> str:
    """The gateway's `/readyz`, asking also for a worker of every served model when they were named
    (`tollway up --model`): "up" means every model answers, not only the first to load."""
    query = urllib.parse.urlencode([("model", model.name) for model in models])
    return f"http://127.0.0.1:{port}/readyz" + (f"?{query}" if query else "")


def run_up(port: int, num_workers: int, worker_port: int, console: Console, quantization: str | None = None,
           models: Sequence[ServedModel] = ()) -> int:
    """Prepare the state folder (database schema, admin key), then supervise until stopped."""
    from accounting.db import upgrade_database
    from accounting.settings import AccountingSettings
    from gateway.settings import GatewaySettings
    from workers.wire.files import load_or_create_admin_key, load_or_create_worker_secret

    settings = GatewaySettings()
    home = settings.home.resolve()
    upgrade_database(AccountingSettings(home=home, database_url=settings.database_url).url)
    _, key_path = load_or_create_admin_key(settings.admin_key, home)
    worker_secret, _ = load_or_create_worker_secret(settings.worker_secret, home)
    where = f"in {key_path}" if key_path else "from TOLLWAY_ADMIN_KEY"
    served = (f"models {', '.join(m.name for m in models)}, {num_workers} engine worker(s) each"
              if models else f"{num_workers} engine worker(s)")
    ready = (f"[green]tollway is up[/]: http://127.0.0.1:{port}/v1 (OpenAI-compatible), "
             f"{served}, a batch worker; admin key {where}; logs in {home / 'logs'}. "
             f"Ctrl-C stops.")
    children = plan_children(home, port, num_workers, worker_port, worker_secret, quantization, models)
    supervisor = Supervisor(children, console)
    return supervisor.run(ready_url(port, models), ready, home / "logs")
