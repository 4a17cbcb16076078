"""Quotas on real Redis: the unreachable-Redis policy, recovery, and several gateway processes at once."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
import pytest_asyncio
import redis as sync_redis

from gateway.quotas.failover import FailoverQuotaStore
from gateway.quotas.local import LocalQuotaStore
from gateway.quotas.redis_store import RedisQuotaStore
from gateway.quotas.store import Limits, QuotaUnavailable
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.services


class TcpProxy:
    """A TCP forwarder to Redis that the test can cut (every connection dropped) and restore."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]  # the same port on every restart

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in self._writers:
                writer.transport.abort()
            self._writers.clear()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers += [writer, up_writer]
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"  # nothing listens there any more


@pytest_asyncio.fixture
async def prefix(redis_url: str) -> AsyncIterator[str]:
    name = f"test-failover-{uuid.uuid4().hex}"
    yield name
    client = sync_redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{name}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.mark.asyncio
async def test_open_mode_falls_back_to_local_limits(prefix: str) -> None:
    store = FailoverQuotaStore(RedisQuotaStore(closed_port_url(), prefix), LocalQuotaStore(), "open", retry_after_s=60)
    limits = Limits(rpm=2, max_concurrent=1)
    try:
        first = await store.admit("t:1", limits, "a", 0)
        assert first.admitted and first.ticket is not None and first.ticket.origin == "local"
        assert store.degraded
        refused = await store.admit("t:1", limits, "b", 0)
        assert (refused.admitted, refused.reason) == (False, "concurrency")  # the local limits hold
        await store.settle(first.ticket, 0)  # back to the local store that issued it
        assert (await store.admit("t:1", limits, "c", 0)).admitted
        assert (await store.admit("t:1", Limits(rpm=2), "d", 0)).reason == "rpm"
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_closed_mode_refuses_while_redis_is_unreachable(prefix: str) -> None:
    store = FailoverQuotaStore(RedisQuotaStore(closed_port_url(), prefix), LocalQuotaStore(), "closed", retry_after_s=60)
    try:
        for request_id in ("a", "b"):
            with pytest.raises(QuotaUnavailable):
                await store.admit("t:1", Limits(rpm=10), request_id, 0)
    finally:
        await store.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_admissions_return_to_redis_by_themselves(redis_url: str, prefix: str, mode: str) -> None:
    url = urlsplit(redis_url)
    proxy = TcpProxy(url.hostname or "127.0.0.1", url.port or 6379)
    await proxy.start()
    primary = RedisQuotaStore(f"redis://127.0.0.1:{proxy.port}{url.path}", prefix)
    store = FailoverQuotaStore(primary, LocalQuotaStore(), mode, retry_after_s=0.2)  # type: ignore[arg-type]
    limits = Limits(rpm=100, max_concurrent=10)
    try:
        before = await store.admit("t:1", limits, "before", 0)
        assert before.ticket is not None and before.ticket.origin == "redis"

        await proxy.stop()  # Redis gone: every pooled connection is cut, new ones are refused
        if mode == "open":
            during = await store.admit("t:1", limits, "during", 0)
            assert during.ticket is not None and during.ticket.origin == "local"
        else:
            with pytest.raises(QuotaUnavailable):
                await store.admit("t:1", limits, "during", 0)
        await store.settle(before.ticket, 5)  # cannot reach Redis: dropped, not raised
        assert store.degraded

        await proxy.start()
        await asyncio.sleep(0.3)  # past retry_after_s
        after = await store.admit("t:1", limits, "after", 0)
        assert after.ticket is not None and after.ticket.origin == "redis" and not store.degraded
        requests = await primary.client.hgetall(primary.key("t:1", "rq"))
        assert sum(int(n) for n in requests.values()) == 2  # "before" and "after"; "during" was local
        leases = await primary.client.zrange(primary.key("t:1", "lease"), 0, -1)
        assert sorted(leases) == [b"after", b"before"]  # the lost settle left its lease to expire
    finally:
        await store.close()
        await proxy.stop()


WORKER = textwrap.dedent("""
    import asyncio, sys, uuid
    from gateway.quotas.redis_store import RedisQuotaStore
    from gateway.quotas.store import Limits

    async def main(url, prefix, mode):
        store = RedisQuotaStore(url, prefix)
        await store.client.ping()
        print("ready", flush=True)
        sys.stdin.readline()  # every process starts firing at once
        if mode == "rpm":
            limits = Limits(rpm=100)
            decisions = await asyncio.gather(*(store.admit("t:shared", limits, uuid.uuid4().hex, 0)
                                               for _ in range(100)))
            print(sum(d.admitted for d in decisions), flush=True)
        else:
            limits, peak = Limits(max_concurrent=8), 0
            async def one():
                nonlocal peak
                while not (d := await store.admit("t:conc", limits, uuid.uuid4().hex, 0)).admitted:
                    await asyncio.sleep(0.002)
                peak = max(peak, await store.client.incr(prefix + ":running"))
                await asyncio.sleep(0.02)
                await store.client.decr(prefix + ":running")
                await store.settle(d.ticket, 0)
            await asyncio.gather(*(one() for _ in range(25)))
            print(peak, flush=True)
        await store.close()

    asyncio.run(main(*sys.argv[1:]))
""")


def run_gateways(redis_url: str, prefix: str, mode: str, processes: int = 4) -> list[int]:
    """Start `processes` OS processes, let them all fire at once, return what each printed."""
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, redis_url, prefix, mode], cwd=REPO_ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0
            results.append(int(out.strip()))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def test_four_processes_admit_exactly_rpm_in_total(redis_url: str, prefix: str) -> None:
    admitted = run_gateways(redis_url, prefix, "rpm")
    assert sum(admitted) == 100, admitted


def test_four_processes_never_run_more_than_max_concurrent(redis_url: str, prefix: str) -> None:
    peaks = run_gateways(redis_url, prefix, "conc")
    assert 4 <= max(peaks) <= 8, peaks  # never above the limit; and the limit was contended
