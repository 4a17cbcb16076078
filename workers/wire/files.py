"""Files that several processes share in $TOLLWAY_HOME: where they live and who creates them.

`admin.key` (mode 600) holds the admin key when TOLLWAY_ADMIN_KEY is unset: `tollway up` (or the
first gateway) creates it, the gateway and the batch runners read it, `tollway up` prints where it is.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

ADMIN_KEY_FILE = "admin.key"


def admin_key_path(home: Path) -> Path:
    return home / ADMIN_KEY_FILE


def load_or_create_admin_key(configured: str | None, home: Path) -> tuple[str, Path | None]:
    """The admin key: TOLLWAY_ADMIN_KEY, else `$TOLLWAY_HOME/admin.key` (created once, mode 600)."""
    if configured:
        return configured, None
    path = admin_key_path(home)
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        key = "tw-admin-" + secrets.token_urlsafe(32)
        with contextlib.suppress(FileExistsError):  # two processes racing: the first one wins
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(key + "\n")
    return path.read_text().strip(), path


def read_admin_key(configured: str | None, home: Path) -> str:
    """The admin key for a process that must not create it (a batch runner); RuntimeError if absent."""
    if configured:
        return configured
    path = admin_key_path(home)
    try:
        return path.read_text().strip()
    except FileNotFoundError as exc:
        raise RuntimeError(f"no admin key: set TOLLWAY_ADMIN_KEY or start the gateway once ({path})") from exc
