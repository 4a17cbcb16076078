"""A private Redis server stopped and restarted under two running gateway processes (fake worker,
SQLite), one with TOLLWAY_QUOTA_FAILURE_MODE=open and one with =closed, under light background
load. While Redis is down the open gateway serves on its own local limits (a tenant's rpm still
holds: 429 past it) and the closed one answers 503 `quota_unavailable`; once Redis is back on the
same port both go back to Redis by themselves (no gateway restart): admissions are written to
Redis again, and the auth invalidation channel is re-subscribed (a key revoked afterwards is
refused at once although its cache TTL is 10 minutes).

`test_fault_reruns.py` re-runs the proxy-cut failover of the quota store in-process; this one is
the real `redis-server` process going away under real gateway processes."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from accounting.api_keys import create_key, revoke_key
from accounting.db import create_db_engine, session_factory
from tests.reliability.services import start_redis
from tests.reliability.stack import Cluster, chat_body, headers, make_tenants, sqlite_url
from workers.wire.key_events import publish_invalidation

pytestmark = [pytest.mark.reliability, pytest.mark.services]
RPM = 12


def chat(url: str, key: str) -> requests.Response:
    return requests.post(f"{url}/v1/chat/completions", json=chat_body(), headers=headers(key), timeout=15)


class Background:
    """Light load: one chat every 50 ms on the open gateway by an unlimited tenant."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.statuses: Counter[int] = Counter()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.statuses[chat(self.url, self.key).status_code] += 1
            except requests.RequestException:
                self.statuses[0] += 1
            time.sleep(0.05)

    def stop(self) -> Counter[int]:
        self.stopped.set()
        self.thread.join(20)
        return self.statuses


def test_gateways_honour_the_policy_and_recover_when_redis_restarts(tmp_path: Path) -> None:
    redis = start_redis(tmp_path / "redis")
    database = sqlite_url(tmp_path)
    keys = make_tenants(database, "open", "closed", rpm=RPM)
    keys |= make_tenants(database, "bg")
    engine = create_db_engine(database)
    with session_factory(engine)() as session, session.begin():
        revocable, keys["revocable"] = create_key(session, "bg")
        revocable_id = revocable.id
    cluster = Cluster.start(tmp_path / "home", database, TOLLWAY_REDIS_URL=redis.url, TOLLWAY_QUOTA_FAILURE_MODE="open",
                            TOLLWAY_AUTH_CACHE_TTL_S="600")
    try:
        open_url = cluster.start_gateway()
        cluster.env["TOLLWAY_QUOTA_FAILURE_MODE"] = "closed"
        closed_url = cluster.start_gateway()
        background = Background(open_url, keys["bg"])

        # Redis up: both serve, and their admissions are in Redis.
        assert chat(open_url, keys["open"]).status_code == 200
        assert chat(closed_url, keys["closed"]).status_code == 200
        assert chat(open_url, keys["revocable"]).status_code == 200  # now cached for 10 minutes
        assert redis.dbsize() > 0

        redis.stop()
        down_at = time.monotonic()
        open_statuses = [chat(open_url, keys["open"]).status_code for _ in range(RPM + 4)]
        closed = [chat(closed_url, keys["closed"]) for _ in range(5)]
        # open: the local store enforces the tenant's rpm from zero (this process's own counters)
        assert open_statuses == [200] * RPM + [429] * 4, open_statuses
        # closed: refused with a clean 503, never served without a quota check
        for response in closed:
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "quota_unavailable"
            assert response.headers["Retry-After"] == "1"
        time.sleep(max(0.0, 3 - (time.monotonic() - down_at)))  # stay down a few seconds under load

        redis.start()  # same port, empty (no persistence)
        restarted_at = time.monotonic()
        deadline = restarted_at + 20
        while chat(closed_url, keys["closed"]).status_code != 200:
            assert time.monotonic() < deadline, "the closed-mode gateway did not recover by itself in 20 s"
            time.sleep(0.2)
        closed_recovery_s = time.monotonic() - restarted_at
        # open: back on Redis, whose counters are fresh: the tenant its local store had exhausted
        # is served again (on local counters it would still get 429)
        while (status := chat(open_url, keys["open"]).status_code) != 200:
            assert status == 429 and time.monotonic() < deadline, status
            time.sleep(0.2)
        open_recovery_s = time.monotonic() - restarted_at
        assert redis.dbsize() > 0

        # the invalidation channel is back: a revocation reaches the open gateway's long-TTL cache
        with session_factory(engine)() as session, session.begin():
            revoke_key(session, revocable_id)
        time.sleep(1.5)  # the listener re-subscribes within ~1 s of Redis coming back
        publish_invalidation(redis.url)
        deadline = time.monotonic() + 5
        while chat(open_url, keys["revocable"]).status_code != 401:
            assert time.monotonic() < deadline, "a revocation did not reach the gateway after Redis came back"
            time.sleep(0.2)

        statuses = background.stop()
        assert set(statuses) == {200}, statuses  # open mode served the unlimited tenant throughout
        print(f"\nbackground: {sum(statuses.values())} requests, all 200; back on Redis after "
              f"{closed_recovery_s:.1f} s (closed) / {open_recovery_s:.1f} s (open)")
    finally:
        engine.dispose()
        cluster.stop()
        redis.stop()
