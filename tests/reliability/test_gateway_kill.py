"""The gateway SIGKILLed mid-stream under real `tollway up` (real default model): every stream in
flight is billed exactly once, for at least the tokens its client received and at most what the
engine generated. The worker keeps each request's usage until a gateway acknowledges the committed
row; the gateway the supervisor restarts bills what its predecessor could not (`gateway_lost`).

Every stream asks for `logprobs`, so each chunk carries one logprob per token: the client's count
of the tokens it received is exact."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.e2e.tollway_up import Tollway, start_tollway
from tests.reliability.test_worker_kill import STREAM_TIMEOUT_S, Stream, run_stream, usage_rows

pytestmark = [pytest.mark.reliability, pytest.mark.slow]
STREAMS = 16


@pytest.fixture(scope="module")
def tollway(smollm2_folder: Path, model_home: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_tollway(tmp_path_factory.mktemp("gateway-kill") / "home", model_home)
    yield running
    running.stop()


def test_a_gateway_killed_mid_stream_bills_every_stream_exactly_once(tollway: Tollway) -> None:
    key = tollway.new_key("acme")
    streams = [Stream() for _ in range(STREAMS)]
    threads = [threading.Thread(target=run_stream, args=(tollway.base_url, key, i, s), daemon=True)
               for i, s in enumerate(streams)]
    for thread in threads:
        thread.start()
    for stream in streams:
        assert stream.first_token.wait(120), "a stream got no token within 120 s"
    victim = tollway.gateway_pid()
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join(STREAM_TIMEOUT_S + 10)
    assert not any(thread.is_alive() for thread in threads), "a client thread hung"
    assert all(s.request_id and s.tokens > 0 and s.outcome != "done" for s in streams), \
        [(s.outcome, s.tokens) for s in streams]

    tollway.wait_healthy(1, timeout_s=120)  # the supervisor restarted the gateway
    assert tollway.gateway_pid() != victim
    deadline = time.monotonic() + 30
    while len(rows := usage_rows(tollway.home)) < STREAMS and time.monotonic() < deadline:
        time.sleep(0.3)
    assert len(rows) == STREAMS, f"{len(rows)} rows for {STREAMS} streams"
    for stream in streams:
        status, completion = rows[stream.request_id]
        assert status == "gateway_lost", (stream.request_id, status)
        assert stream.tokens <= completion <= 160, (stream.request_id, stream.tokens, completion)

    report = json.loads(tollway.cli("usage", "report", "--month", datetime.now(UTC).strftime("%Y-%m"),
                                    "--format", "json"))
    [model] = report["models"]
    assert model["requests"] == STREAMS
    assert model["completion_tokens"] == sum(completion for _, completion in rows.values())
    print(f"\nkilled the gateway with {STREAMS} streams in flight; clients had "
          f"{sum(s.tokens for s in streams)} tokens, billed {model['completion_tokens']} (gateway_lost)")
