"""Every outbound wait of the gateway has a bound: a frame the worker will not read, a cancel, and
a batch dispatch to a broker that hangs all give up in time (the long wait for a request's lines is
bounded by the channel's heartbeat instead: see gateway/upstream/channel.py)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gateway.batches import dispatch as dispatch_module
from gateway.batches.dispatch import BATCH_DISPATCHER, CeleryDispatcher, dispatch
from gateway.upstream import channel as channel_module
from gateway.upstream.channel import ChannelClosed, WorkerChannel
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from tests.net import silent_listener
from tests.unit.gateway.test_worker_channel import body
from workers.wire.batches import RUN_TASK, broker_url


@pytest.mark.asyncio
async def test_a_frame_the_worker_does_not_take_fails_the_request_in_time(aiohttp_server,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    server = await aiohttp_server(create_fake_worker_app(FakeWorker()))
    monkeypatch.setattr(channel_module, "SEND_TIMEOUT_S", 0.2)
    async with aiohttp.ClientSession() as session:
        channel = WorkerChannel(str(server.make_url("")).rstrip("/"), session, 2.0,
                                {"Authorization": f"Bearer {FAKE_WORKER_SECRET}"})
        assert len([line async for line in channel.generate(body("warm"), {})]) == 6
        connection = channel._connection
        assert connection is not None
        stuck = asyncio.Event()

        async def never_drains(data: bytes, compress: int | None = None) -> None:  # a full socket buffer
            await stuck.wait()

        monkeypatch.setattr(connection.ws, "send_bytes", never_drains)
        started = time.monotonic()
        with pytest.raises(ChannelClosed, match="cannot send"):
            [line async for line in channel.generate(body("stuck"), {})]
        assert not await channel.cancel("warm")  # the cancel verb gives up too (the pool then uses HTTP)
        assert time.monotonic() - started < 2
        monkeypatch.undo()
        await channel.close()


@pytest.mark.asyncio
async def test_a_dispatch_to_a_hanging_broker_gives_up_and_leaves_the_batch_to_the_sweep(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    released = threading.Event()

    class HangingBroker:
        def dispatch(self, batch_id: str) -> None:
            released.wait(5)

    app = web.Application()
    app[BATCH_DISPATCHER] = HangingBroker()
    monkeypatch.setattr(dispatch_module, "DISPATCH_TIMEOUT_S", 0.2)
    started = time.monotonic()
    try:
        assert await dispatch(app, "batch_x") is False
    finally:
        released.set()
    assert time.monotonic() - started < 2
    assert "the batch sweep will queue it" in caplog.text


def test_the_celery_producer_gives_up_on_a_redis_that_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch's own thread is bounded too (broker timeouts), not only the request's wait."""
    monkeypatch.setattr(dispatch_module, "BROKER_TIMEOUT_S", 0.5)
    with silent_listener() as port:
        dispatcher = CeleryDispatcher(f"redis://127.0.0.1:{port}/0")
        assert dispatcher._celery().conf.broker_transport_options["socket_timeout"] == 0.5
        started = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 (kombu's or redis' error, whichever gives up first)
            dispatcher.dispatch("batch_x")
    assert time.monotonic() - started < 10


def test_a_dispatch_lands_on_the_embedded_sqlite_broker(tmp_path: Path) -> None:
    """`tollway up`'s broker (kombu's SQLAlchemy transport on SQLite, as `broker_url` names it) takes the run task
    at once: its message is in the broker's table. (Redis's socket timeouts, once set for every transport, made
    `create_engine` refuse every dispatch there, and each batch waited for the sweep.)"""
    url = broker_url(None, None, tmp_path)
    dispatcher = CeleryDispatcher(url)
    dispatcher.dispatch("batch_x")
    with sqlite3.connect(tmp_path / "celery-broker.sqlite") as db:
        payloads = [json.loads(row[0]) for row in db.execute("SELECT payload FROM kombu_message")]
    assert [p["headers"]["task"] for p in payloads] == [RUN_TASK]
    assert [p["headers"]["argsrepr"] for p in payloads] == ["['batch_x']"]
