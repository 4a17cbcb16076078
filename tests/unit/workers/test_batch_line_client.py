"""workers/jobs/line_client.py against a scripted HTTP server: what is recorded, what is retried."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from workers.jobs import line_client
from workers.jobs.line_client import Unavailable, send_line

pytestmark = pytest.mark.asyncio


def error(status: int, code: str | None = None) -> tuple[int, dict]:
    return status, {"error": {"message": "x", "type": "t", "param": None, "code": code}}


def ok(body: dict) -> tuple[int, dict]:
    return 200, body


async def scripted(aiohttp_server, answers: list[tuple[int, dict]]):
    """A server answering POST /v1/completions with `answers` in turn (the last one repeats); the
    requests it saw."""
    seen: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append({"headers": dict(request.headers), "body": await request.json()})
        status, body = answers[min(len(seen), len(answers)) - 1]
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/"), seen


async def send(url: str, should_stop=lambda: False) -> line_client.Answer:
    async with aiohttp.ClientSession() as session:
        return await send_line(session, url, "/v1/completions", "admin", "batch_1", 7, {"model": "m", "prompt": "x"},
                               timeout_s=5, should_stop=should_stop)


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(line_client, "BACKOFF_S", (0.01,))


async def test_a_line_carries_the_batch_and_its_idempotency_key(aiohttp_server) -> None:
    url, seen = await scripted(aiohttp_server, [ok({"id": "cmpl-1"})])
    answer = await send(url)
    assert (answer.status, answer.body) == (200, {"id": "cmpl-1"})
    headers = seen[0]["headers"]
    assert headers["Authorization"] == "Bearer admin" and headers["X-Tollway-Batch-Id"] == "batch_1"
    assert headers["Idempotency-Key"] == "batch_1:7" and seen[0]["body"] == {"model": "m", "prompt": "x"}


async def test_a_client_error_is_final(aiohttp_server) -> None:
    url, seen = await scripted(aiohttp_server, [error(400), ok({})])
    assert (await send(url)).status == 400 and len(seen) == 1


async def test_a_spent_monthly_budget_is_final(aiohttp_server) -> None:
    url, seen = await scripted(aiohttp_server, [error(429, "insufficient_quota"), ok({})])
    answer = await send(url)
    assert answer.status == 429 and answer.body["error"]["code"] == "insufficient_quota" and len(seen) == 1


async def test_busy_and_in_use_answers_are_retried_until_a_final_one(aiohttp_server) -> None:
    url, seen = await scripted(aiohttp_server, [error(503), error(429), error(409, "idempotency_key_in_use"),
                                                ok({"id": "cmpl-2"})])
    assert (await send(url)).body == {"id": "cmpl-2"} and len(seen) == 4


async def test_engine_errors_are_tried_three_times_then_recorded(aiohttp_server) -> None:
    url, seen = await scripted(aiohttp_server, [error(502, "engine_error")] * 5)
    assert (await send(url)).status == 502 and len(seen) == line_client.MAX_ERROR_ATTEMPTS


async def test_no_final_answer_when_the_batch_stops_or_the_runner_is_refused(aiohttp_server) -> None:
    url, _ = await scripted(aiohttp_server, [error(503)])
    with pytest.raises(Unavailable) as stopped:
        await send(url, should_stop=lambda: True)
    assert not stopped.value.stop_batch
    url, _ = await scripted(aiohttp_server, [error(409, "batch_not_running")])
    with pytest.raises(Unavailable) as changed:
        await send(url)
    assert changed.value.stop_batch
    url, _ = await scripted(aiohttp_server, [error(401)])
    with pytest.raises(Unavailable):
        await send(url)
    with pytest.raises(Unavailable):  # nothing listens there: retried until told to stop
        calls = iter(range(3))
        await send("http://127.0.0.1:9", should_stop=lambda: next(calls, None) is None)
