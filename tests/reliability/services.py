"""Private Redis and PostgreSQL servers for the fault tests: started on a free port in a temp
folder, stopped and restarted by the test, removed afterwards. The machine's own servers (6379,
5432) are never touched. Each `start_*` skips the test with the reason when it cannot run here
(fails it under TOLLWAY_REQUIRE_SERVICES=1: tests/required.py). PostgreSQL's server binaries are
found, not assumed: `pg_config --bindir`, else the newest /usr/lib/postgresql/*/bin."""

from __future__ import annotations

import functools
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.net import free_port
from tests.required import unavailable


@functools.cache
def postgres_bin() -> Path | None:
    """The folder of initdb and pg_ctl: `pg_config --bindir` (libpq's packages put pg_config on PATH),
    else the newest version under /usr/lib/postgresql (Debian keeps server binaries off PATH)."""
    candidates: list[Path] = []
    if shutil.which("pg_config"):
        done = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False, timeout=10)
        if done.returncode == 0 and done.stdout.strip():
            candidates.append(Path(done.stdout.strip()))

    def version(folder: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", folder.parent.name)) or (0,)

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    if shutil.which("initdb"):
        candidates.append(Path(shutil.which("initdb")).parent)  # type: ignore[arg-type]
    return next((folder for folder in candidates if (folder / "initdb").exists()
                 and (folder / "pg_ctl").exists()), None)


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
        unavailable("redis-server / redis-cli are not on PATH")
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
        bindir = postgres_bin()
        assert bindir is not None  # start_postgres checked
        command = [str(bindir / "pg_ctl"), "-D", str(self.folder / "data"), "-w", "-t", "30", *args]
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
    bindir = postgres_bin()
    if bindir is None:
        unavailable("PostgreSQL's server binaries (initdb, pg_ctl) not found: neither `pg_config --bindir` "
                    "nor /usr/lib/postgresql/*/bin has them")
    user = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            unavailable("running as root without runuser: initdb refuses root")
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            unavailable("running as root and there is no `postgres` OS user to run initdb as")
        user = "postgres"
    folder = Path(tempfile.mkdtemp(prefix="tollway-pg-"))
    shutil.chown(folder, user=user)
    server = PrivatePostgres(folder, free_port(), user)
    initdb = [str(bindir / "initdb"), "-D", str(folder / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8",
              "--no-sync"]
    done = subprocess.run(as_user(user, initdb), capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        unavailable(f"initdb failed here: {done.stderr.strip()[-300:]}")
    server.start()
    return server
