"""Real gateway processes (`tollway gateway`) in front of a fake worker process, for the
integration tests of quotas and metering across replicas and crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from accounting.api_keys import create_key
from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.tenants import create_tenant
from tests.net import free_port, get_json


def wait_for(url: str, ready, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                body = json.loads(response.read())
                if ready(body):
                    return body
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready within {timeout_s} s")




def prepare_tenant(database_url: str, **quotas: int) -> str:
    """Migrate the database and create tenant 'acme' with `quotas`; its API key."""
    engine = create_db_engine(database_url)
    upgrade_database(engine)
    with session_factory(engine)() as session, session.begin():
        create_tenant(session, "acme", **quotas)
        _, key = create_key(session, "acme")
    engine.dispose()
    return key


@dataclass
class Cluster:
    home: Path
    env: dict[str, str]
    worker_url: str
    worker: subprocess.Popen[bytes]
    gateways: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)  # port → process

    @classmethod
    def start(cls, home: Path, database_url: str, delay_s: float = 0.0, **env: str) -> Cluster:
        home.mkdir(parents=True, exist_ok=True)
        port = free_port()
        # The fake worker and the gateways find the workers' secret in the same home, as `tollway up`'s do.
        worker = subprocess.Popen([sys.executable, "-m", "ops.fake_worker", "--port", str(port),
                                   "--delay-s", str(delay_s)], stdout=subprocess.DEVNULL,
                                  stderr=(home / "worker.log").open("wb"), env={**os.environ, "TOLLWAY_HOME": str(home)})
        url = f"http://127.0.0.1:{port}"
        wait_for(f"{url}/healthz", lambda body: True, worker)
        env = {**os.environ, "TOLLWAY_HOME": str(home), "TOLLWAY_DATABASE_URL": database_url,
               "TOLLWAY_WORKER_URLS": url, "TOLLWAY_ADMIN_KEY": "tw-admin-test", **env}
        return cls(home, env, url, worker)

    def start_gateway(self, port: int | None = None) -> str:
        port = port or free_port()
        log = (self.home / f"gateway-{port}.log").open("ab")
        process = subprocess.Popen([sys.executable, "-m", "ops.cli", "gateway", "--port", str(port)],
                                   env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.gateways[port] = process
        url = f"http://127.0.0.1:{port}"
        wait_for(f"{url}/readyz", lambda body: body["status"] == "ready", process)
        return url

    def kill_gateway(self, port: int) -> None:
        self.gateways.pop(port).send_signal(signal.SIGKILL)

    def worker_info(self) -> dict:
        secret = (self.home / "worker.secret").read_text().strip()
        return get_json(f"{self.worker_url}/internal/info", {"Authorization": f"Bearer {secret}"})

    def stop(self) -> None:
        for process in [*self.gateways.values(), self.worker]:
            process.terminate()
        for process in [*self.gateways.values(), self.worker]:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
