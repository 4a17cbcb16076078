"""A real gateway process in front of the fake worker (`ops.fake_worker`), with named tenants.

The reliability tests about the gateway's own behaviour (hostile input, isolation, faults on its
services) use this: real processes over real sockets, no model, so hundreds of requests take
seconds. Built on `tests.integration.gateway_cluster.Cluster`.
"""

from __future__ import annotations

import re
from pathlib import Path

from accounting.api_keys import create_key
from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.tenants import create_tenant
from tests.integration.gateway_cluster import Cluster

ADMIN_KEY = "tw-admin-test"  # what Cluster.start gives its gateways
MODEL = "smollm2-135m-instruct"
KEY_PATTERN = re.compile(r"tw-[A-Za-z0-9_-]{20,}")


def make_tenants(database_url: str, *names: str, **quotas: int) -> dict[str, str]:
    """Migrate the database and create each tenant with one API key; name → key."""
    engine = create_db_engine(database_url)
    upgrade_database(engine)
    keys = {}
    with session_factory(engine)() as session, session.begin():
        for name in names:
            create_tenant(session, name, **quotas)
            _, keys[name] = create_key(session, name)
    engine.dispose()
    return keys


def sqlite_url(home: Path) -> str:
    return f"sqlite:///{home / 'tollway.db'}"


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(content: str = "hi", max_tokens: int = 4, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            **fields}


def leaked_keys(folder: Path, keys: list[str]) -> dict[str, list[str]]:
    """Every log file under `folder` that contains one of `keys` (or any key-shaped string)."""
    found: dict[str, list[str]] = {}
    for path in folder.rglob("*.log"):
        text = path.read_text(errors="replace")
        hits = [key[:10] + "…" for key in keys if key in text]
        hits += [m[:10] + "…" for m in KEY_PATTERN.findall(text) if m not in keys]
        if hits:
            found[str(path)] = hits
    return found


__all__ = ["ADMIN_KEY", "MODEL", "Cluster", "chat_body", "headers", "leaked_keys", "make_tenants", "sqlite_url"]
