"""`tollway up` as a real process tree for e2e tests: start, find children, stop."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.test_generate_cli import tollway_executable
from tests.net import free_port, get_json


def child_pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False)
    return [int(pid) for pid in found.stdout.split()]


@dataclass
class Tollway:
    process: subprocess.Popen[str]
    home: Path
    port: int
    worker_port: int
    num_workers: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "TOLLWAY_HOME": str(self.home)}

    def cli(self, *args: str) -> str:
        """Run a `tollway` command against the same home; its stdout."""
        done = subprocess.run([tollway_executable(), *args], env=self.env(), capture_output=True, text=True,
                              check=False, timeout=120)
        if done.returncode != 0:
            raise AssertionError(f"tollway {' '.join(args)} failed: {done.stderr}")
        return done.stdout

    def worker_auth(self) -> dict[str, str]:
        """The header of a call to one of its workers' /internal/* routes (the secret `up` made)."""
        return {"Authorization": f"Bearer {(self.home / 'worker.secret').read_text().strip()}"}

    def new_key(self, tenant: str) -> str:
        self.cli("tenants", "create", tenant)
        return self.cli("keys", "create", "--tenant", tenant).strip()

    def worker_pid(self, index: int) -> int:
        [pid] = child_pids(f"ops.cli worker --port {self.worker_port + index}")
        return pid

    def gateway_pid(self) -> int:
        [pid] = child_pids(f"ops.cli gateway --port {self.port}")
        return pid

    def wait_healthy(self, workers: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"tollway up exited: {self.process.stderr.read() if self.process.stderr else ''}")
            try:
                if get_json(f"{self.base_url}/healthz")["workers_healthy"] >= workers:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"tollway up was not healthy within {timeout_s} s; logs in {self.home / 'logs'}")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


def start_tollway(home: Path, model_home: Path, num_workers: int = 1, models: Sequence[str] = (),
                  **env: str) -> Tollway:
    """`tollway up` on a fresh home that shares the converted models of the test model home; `models`:
    its `--model` values (`num_workers` workers each), none = the default model."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to((model_home / "models").resolve(), target_is_directory=True)
    port, worker_port = free_port(), free_port()
    total = num_workers * max(1, len(models))
    process = subprocess.Popen(
        [tollway_executable(), "up", "--port", str(port), "--workers", str(num_workers),
         "--worker-port", str(worker_port), *(arg for model in models for arg in ("--model", model))],
        env={**os.environ, "TOLLWAY_HOME": str(home), "TOLLWAY_KV_CACHE_MB": "512", **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    tollway = Tollway(process, home, port, worker_port, total)
    try:
        tollway.wait_healthy(total)
    except BaseException:
        tollway.stop()
        raise
    return tollway
