"""A private PostgreSQL server (initdb + pg_ctl, its own port and socket folder) stopped and
restarted under a running gateway process (fake worker) with requests flowing.

With the default auth cache TTL (5 s, shorter than the 7 s outage): while the database is down
every request with a key the gateway looked up before the outage is served (an expired cache
entry is used as is while the lookup cannot reach the database), and its usage row is spooled durably to `$TOLLWAY_HOME/spool/` by the gateway's UsageWriter; after
the restart the spool is replayed by itself. Then every request that got a response has exactly
one usage row (no loss, no duplicates). A key the gateway never saw cannot be checked while the
database is down: it gets a clean 503, never a 5xx without an error object or a hang."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import requests
from sqlalchemy import create_engine, text

from tests.reliability.services import start_postgres
from tests.reliability.stack import Cluster, chat_body, headers, make_tenants

pytestmark = [pytest.mark.reliability, pytest.mark.services]
CLIENTS = 3


class Load:
    """CLIENTS threads sending chats (streamed every other time) until stopped; the ids served."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.served: list[tuple[float, str]] = []  # (when, request id) of every 200
        self.failures: list[str] = []
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]
        for thread in self.threads:
            thread.start()

    def _one(self, stream: bool) -> str:
        body = chat_body(max_tokens=6, stream=stream)
        with requests.post(f"{self.url}/v1/chat/completions", json=body, headers=headers(self.key), timeout=15,
                           stream=stream) as response:
            if response.status_code != 200:
                raise AssertionError(f"{response.status_code}: {response.text[:200]}")
            if not stream:
                return response.json()["id"]
            lines = [line for line in response.iter_lines() if line.startswith(b"data: ")]
            assert lines[-1] == b"data: [DONE]", lines[-2:]
            return json.loads(lines[0][6:])["id"]

    def _run(self, index: int) -> None:
        n = 0
        while not self.stopped.is_set():
            try:
                self.served.append((time.monotonic(), self._one(stream=(n + index) % 2 == 1)))
            except (AssertionError, requests.RequestException) as exc:
                self.failures.append(repr(exc))
            n += 1
            time.sleep(0.02)

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(30)


def usage_ids(url: str) -> list[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return [row[0] for row in connection.execute(text("SELECT request_id FROM usage_events"))]
    finally:
        engine.dispose()


def test_usage_survives_a_postgres_restart_exactly_once(tmp_path: Path) -> None:
    server = start_postgres()
    cluster = None
    try:
        keys = make_tenants(server.url, "a", "never-seen")
        cluster = Cluster.start(tmp_path / "home", server.url)
        url = cluster.start_gateway()
        load = Load(url, keys["a"])
        time.sleep(2)

        server.stop()
        down_from = time.monotonic()
        unknown = requests.post(f"{url}/v1/chat/completions", json=chat_body(), headers=headers(keys["never-seen"]),
                                timeout=30)
        time.sleep(7)
        spool = cluster.home / "spool"
        spooled = sum(len(path.read_bytes().splitlines()) for path in spool.glob("*.jsonl"))
        server.start()
        down_until = time.monotonic()
        time.sleep(3)
        load.stop()

        assert not load.failures, load.failures[:5]
        during = [rid for when, rid in load.served if down_from + 0.5 < when < down_until]
        assert len(during) >= 20, f"only {len(during)} requests served while PostgreSQL was down"
        assert spooled >= len(during), (spooled, len(during))  # their rows went to the spool on disk
        assert unknown.status_code == 503, (unknown.status_code, unknown.text[:300])
        assert unknown.json()["error"]["code"] == "auth_unavailable"

        served = [rid for _, rid in load.served]
        assert len(set(served)) == len(served)
        deadline = time.monotonic() + 20
        while len(rows := usage_ids(server.url)) < len(served) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(rows) == len(set(rows)), "duplicate usage rows"
        missing = set(served) - set(rows)
        assert not missing, f"{len(missing)} of {len(served)} served requests have no usage row"
        assert set(rows) == set(served), f"rows without a served request: {sorted(set(rows) - set(served))[:5]}"
        print(f"\nserved {len(served)} requests ({len(during)} while PostgreSQL was down {down_until - down_from:.1f} s, "
              f"{spooled} rows spooled); {len(rows)} usage rows after the restart, none missing or doubled")
    finally:
        if cluster is not None:
            cluster.stop()
        server.remove()
