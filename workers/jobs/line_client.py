"""Sending one batch line to the gateway over HTTP, and sorting its answer.

Each line is POSTed to the gateway's own `/v1/chat/completions`, `/v1/completions` or `/v1/responses` (same routing,
metering and tracing as interactive traffic) with the admin key, `X-Tollway-Batch-Id` and an
`Idempotency-Key` of `<batch id>:<line>`: if a runner dies after the gateway billed a line but
before the result was recorded, the next runner gets the stored answer back instead of running
(and billing) the line again.

`send_line` returns an `Answer` (a final HTTP answer to record: 200, or an error that retrying
cannot fix) or raises `Unavailable` (the gateway could not answer now: retry later, record nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from workers.wire.batches import BATCH_HEADER

RETRYABLE_STATUSES = (429, 500, 502, 503, 504)
"""Answers worth another attempt (a 500/502/504 at most `MAX_ERROR_ATTEMPTS` times)."""
MAX_ERROR_ATTEMPTS = 3
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]


class Unavailable(Exception):
    """No final answer for now (gateway unreachable, overloaded, refusing the runner, or the batch
    stopped running there); `stop_batch` when the gateway says the batch is no longer running."""

    def __init__(self, message: str, stop_batch: bool = False) -> None:
        super().__init__(message)
        self.stop_batch = stop_batch


def _error_code(body: dict[str, Any]) -> str | None:
    error = body.get("error")
    return error.get("code") if isinstance(error, dict) else None


async def _post_once(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                     timeout_s: float) -> Answer:
    async with session.post(url, data=orjson.dumps(body), headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        raw = await response.read()
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        return Answer(502, {"error": {"message": "the gateway's answer was not a JSON object",
                                      "type": "upstream_error", "param": None, "code": "bad_gateway_answer"}})
    return Answer(response.status, parsed)


async def send_line(session: aiohttp.ClientSession, gateway_url: str, endpoint: str, admin_key: str,
                    batch_id: str, line: int, body: dict[str, Any], *, timeout_s: float,
                    should_stop: Callable[[], bool] = lambda: False,
                    trace_headers: dict[str, str] | None = None) -> Answer:
    """The line's final answer; what can be retried is retried (with backoff) until `should_stop()`.
    `trace_headers` (a `traceparent`) make the gateway's request span part of the line's trace."""
    headers = {"Authorization": f"Bearer {admin_key}", BATCH_HEADER: batch_id,
               "Idempotency-Key": f"{batch_id}:{line}", "Content-Type": "application/json", **(trace_headers or {})}
    url = gateway_url.rstrip("/") + endpoint
    errors = 0
    attempt = 0
    while True:
        try:
            answer: Answer | None = await _post_once(session, url, body, headers, timeout_s)
        except (aiohttp.ClientError, TimeoutError, OSError):
            answer = None  # unreachable, or no answer in time: retried (the Idempotency-Key makes it safe)
        if answer is not None:
            code = _error_code(answer.body)
            if answer.status == 409 and code == "batch_not_running":
                raise Unavailable("the gateway says the batch no longer runs", stop_batch=True)
            if answer.status == 401:
                raise Unavailable("the gateway refused the runner's admin key")
            in_use = answer.status == 409 and code == "idempotency_key_in_use"  # an earlier attempt still runs
            if (answer.status not in RETRYABLE_STATUSES and not in_use) or code == "insufficient_quota":
                return answer  # (the tenant's monthly budget cannot fit the line: waiting does not help)
            if answer.status in (500, 502, 504):
                errors += 1
                if errors >= MAX_ERROR_ATTEMPTS:
                    return answer  # recorded as the line's failure
        if should_stop():
            raise Unavailable("the batch is stopping before this line got an answer")
        await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
        attempt += 1
