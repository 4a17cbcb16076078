"""Private Redis and PostgreSQL servers for the fault tests: started on a free port in a temp
folder, stopped and restarted by the test, removed afterwards. The machine's own servers (6379,
5432) are never touched. Each `start_*` skips the test with the reason when it cannot run here."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.net import free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def wait_port(port: int, up: bool, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                if up:
                    return
        except OSError:
            if not up:
                return
        time.sleep(0.1)
    raise AssertionError(f"port {port} did not go {'up' if up else 'down'} within {timeout_s} s")


@dataclass
class PrivateRedis:
    folder: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder)], stdout=(self.folder / "redis.log").open("ab"), stderr=subprocess.STDOUT)
        wait_port(self.port, up=True)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=20)
            self.process = None
        wait_port(self.port, up=False)

    def dbsize(self) -> int:
        done = subprocess.run(["redis-cli", "-p", str(self.port), "dbsize"], capture_output=True, text=True,
                              timeout=10, check=True)
        return int(done.stdout.strip())


def start_redis(folder: Path) -> PrivateRedis:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli are not on PATH")
    folder.mkdir(parents=True, exist_ok=True)
    redis = PrivateRedis(folder, free_port())
    redis.start()
    return redis


@dataclass
class PrivatePostgres:
    folder: Path  # owned by the `postgres` OS user; data/ and the socket live here
    port: int
    user: str

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        command = [str(PG_BIN / "pg_ctl"), "-D", str(self.folder / "data"), "-w", "-t", "30", *args]
        subprocess.run(as_user(self.user, command), check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-l", str(self.folder / "postgres.log"), "-o", options, "start")
        wait_port(self.port, up=True)

    def stop(self) -> None:
        self._ctl("-m", "fast", "stop")
        wait_port(self.port, up=False)

    def remove(self) -> None:
        try:
            if (self.folder / "data" / "postmaster.pid").exists():
                self.stop()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def as_user(user: str, command: list[str]) -> list[str]:
    return command if os.geteuid() != 0 else ["runuser", "-u", user, "--", *command]


def start_postgres() -> PrivatePostgres:
    """initdb + pg_ctl start on a free port; as root the server runs as the `postgres` OS user."""
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"PostgreSQL binaries not found in {PG_BIN}")
    user = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser: initdb refuses root")
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no `postgres` OS user to run initdb as")
        user = "postgres"
    folder = Path(tempfile.mkdtemp(prefix="tollway-pg-"))
    shutil.chown(folder, user=user)
    server = PrivatePostgres(folder, free_port(), user)
    initdb = [str(PG_BIN / "initdb"), "-D", str(folder / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8",
              "--no-sync"]
    done = subprocess.run(as_user(user, initdb), capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"initdb failed here: {done.stderr.strip()[-300:]}")
    server.start()
    return server
