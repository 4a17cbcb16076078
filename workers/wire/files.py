"""Files that several processes share in $TOLLWAY_HOME: where they live and who creates them.

- `admin.key` (mode 600) holds the admin key when TOLLWAY_ADMIN_KEY is unset: `tollway up` (or the
  first gateway) creates it, the gateway and the batch runners read it, `tollway up` prints where it is.
- `worker.secret` (mode 600) holds the workers' shared secret when TOLLWAY_WORKER_SECRET is unset:
  the credential a gateway presents on every call to a worker's `/internal/*` API. `tollway up`
  creates it once and hands it to its gateway and workers; a lone `tollway gateway` or `tollway
  worker` loads it from its own home, creating it there if absent. Processes on different hosts
  (different homes) must all be given the same TOLLWAY_WORKER_SECRET: otherwise each side makes
  its own, and the workers refuse the gateway (401; the gateway logs which setting differs).

Both files are created atomically: written in full to a temporary file, then hard-linked into place,
so a reader never sees an empty or partial file, and of two processes racing the first one wins.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path

ADMIN_KEY_FILE = "admin.key"
WORKER_SECRET_FILE = "worker.secret"


def admin_key_path(home: Path) -> Path:
    return home / ADMIN_KEY_FILE


def worker_secret_path(home: Path) -> Path:
    return home / WORKER_SECRET_FILE


def _load_or_create(path: Path, make: Callable[[], str]) -> str:
    """The file's text, stripped; created first with `make()` (mode 600) when absent."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")  # mode 600
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(make() + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            with contextlib.suppress(FileExistsError):  # two processes racing: the first one wins
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    value = path.read_text().strip()
    if not value:
        raise RuntimeError(f"{path} is empty: remove it to have a new one made")
    return value


def load_or_create_admin_key(configured: str | None, home: Path) -> tuple[str, Path | None]:
    """The admin key: TOLLWAY_ADMIN_KEY, else `$TOLLWAY_HOME/admin.key` (created once, mode 600)."""
    if configured:
        return configured, None
    path = admin_key_path(home)
    return _load_or_create(path, lambda: "tw-admin-" + secrets.token_urlsafe(32)), path


def read_admin_key(configured: str | None, home: Path) -> str:
    """The admin key for a process that must not create it (a batch runner); RuntimeError if absent."""
    if configured:
        return configured
    path = admin_key_path(home)
    try:
        return path.read_text().strip()
    except FileNotFoundError as exc:
        raise RuntimeError(f"no admin key: set TOLLWAY_ADMIN_KEY or start the gateway once ({path})") from exc


def load_or_create_worker_secret(configured: str | None, home: Path) -> tuple[str, Path | None]:
    """The workers' shared secret: TOLLWAY_WORKER_SECRET, else `$TOLLWAY_HOME/worker.secret`
    (created once, mode 600). Also which file it came from (None: the setting)."""
    if configured:
        return configured, None
    path = worker_secret_path(home)
    return _load_or_create(path, lambda: "tw-worker-" + secrets.token_urlsafe(32)), path
