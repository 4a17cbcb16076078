"""An engine worker SIGKILLed mid-stream under real `tollway up --workers 2` (real default model):
its streaming clients get a clean SSE error event (bounded in time, no hang) and are billed exactly
the tokens they received (usage status `upstream_error`), the streams on the other worker finish,
and the supervisor restarts the killed worker.

Real workers rather than `ops/fake_worker.py` because the point is the supervisor's restart and
the real worker's streams; the model is small enough that `up --workers 2` starts in ~20 s.
Every stream asks for `logprobs`, so each chunk carries one logprob per token: the client's own
count of the tokens it received is exact, and is compared with the usage row."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from sqlalchemy import create_engine, text

from tests.e2e.tollway_up import Tollway, start_tollway
from tests.net import get_json
from tests.reliability.stack import MODEL, headers

pytestmark = [pytest.mark.reliability, pytest.mark.slow]
STREAMS = 6
MAX_TOKENS = 160
STREAM_TIMEOUT_S = 60  # every stream must end (done or error event) within this


@dataclass
class Stream:
    request_id: str | None = None
    tokens: int = 0  # tokens received, counted from the chunks' logprobs
    outcome: str = "open"  # done | error | hung | http-<status> | exception
    error: dict | None = None
    first_token: threading.Event = field(default_factory=threading.Event)
    ended_at: float = 0.0


def run_stream(url: str, key: str, index: int, stream: Stream) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": index,
            "ignore_eos": True, "logprobs": True,
            "messages": [{"role": "user", "content": f"Story {index}: tell me about the number {index * 7919}."}]}
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, headers=headers(key), stream=True,
                           timeout=(5, STREAM_TIMEOUT_S)) as response:
            if response.status_code != 200:
                stream.outcome = f"http-{response.status_code}"
                return
            for raw in response.iter_lines():
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:]
                if data == b"[DONE]":
                    stream.outcome = "done"
                    return
                event = json.loads(data)
                if "error" in event:
                    stream.outcome, stream.error = "error", event["error"]
                    return
                stream.request_id = event["id"]
                for choice in event["choices"]:
                    stream.tokens += len((choice.get("logprobs") or {}).get("content") or [])
                if stream.tokens:
                    stream.first_token.set()
            stream.outcome = "ended-without-done"
    except requests.exceptions.ReadTimeout:
        stream.outcome = "hung"
    except requests.RequestException as exc:
        stream.outcome = f"exception: {exc!r}"
    finally:
        stream.ended_at = time.monotonic()
        stream.first_token.set()


def usage_rows(home: Path) -> dict[str, tuple[str, int]]:
    engine = create_engine(f"sqlite:///{home / 'tollway.db'}")
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT request_id, status, completion_tokens FROM usage_events"))
        found = {row[0]: (row[1], row[2]) for row in rows}
    engine.dispose()
    return found


@pytest.fixture(scope="module")
def tollway(smollm2_folder: Path, model_home: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_tollway(tmp_path_factory.mktemp("worker-kill") / "home", model_home, num_workers=2)
    yield running
    running.stop()


def test_a_worker_killed_mid_stream(tollway: Tollway) -> None:
    key = tollway.new_key("acme")
    worker_urls = [f"http://127.0.0.1:{tollway.worker_port + i}" for i in range(2)]
    streams = [Stream() for _ in range(STREAMS)]
    threads = [threading.Thread(target=run_stream, args=(tollway.base_url, key, i, s), daemon=True)
               for i, s in enumerate(streams)]
    for thread in threads:
        thread.start()
    for stream in streams:
        assert stream.first_token.wait(60), "a stream got no token within 60 s"
    victim = tollway.worker_pid(0)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()

    for thread in threads:
        thread.join(STREAM_TIMEOUT_S + 10)
    assert not any(thread.is_alive() for thread in threads), "a client thread hung"
    outcomes = [s.outcome for s in streams]
    errors = [s for s in streams if s.outcome == "error"]
    done = [s for s in streams if s.outcome == "done"]
    assert len(errors) + len(done) == STREAMS, outcomes  # every stream ended cleanly, none hung
    # The router spreads the six over both workers (the worker's /internal/info counts only its
    # scheduler's queues, not requests between steps, so the split is read from the outcomes).
    assert errors and done, f"expected streams on both workers: {outcomes}"
    for stream in errors:
        assert stream.error and stream.error["code"] == "worker_failed", stream.error
        assert 0 < stream.tokens < MAX_TOKENS
    for stream in done:
        assert stream.tokens == MAX_TOKENS
    error_s = max(s.ended_at for s in errors) - killed_at
    assert error_s < 10, f"the killed worker's clients waited {error_s:.1f} s for their error event"

    # Billing: one row per request, with exactly the tokens the client received.
    deadline = time.monotonic() + 10
    while len(rows := usage_rows(tollway.home)) < STREAMS and time.monotonic() < deadline:
        time.sleep(0.2)
    for stream in streams:
        status, completion = rows[stream.request_id]
        assert status == ("upstream_error" if stream.outcome == "error" else "ok"), (stream, status)
        assert completion == stream.tokens, (stream.request_id, completion, stream.tokens)

    # The supervisor restarts the killed worker: a new process, healthy again, serving.
    tollway.wait_healthy(2, timeout_s=120)
    assert get_json(f"{worker_urls[0]}/healthz")["status"] == "ok"
    assert tollway.worker_pid(0) != victim
    restarted_s = time.monotonic() - killed_at
    answer = requests.post(f"{tollway.base_url}/v1/chat/completions", headers=headers(key), timeout=60,
                           json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text
    print(f"\nkilled worker 0 with {len(errors)} streams on it and {len(done)} on worker 1; "
          f"error tokens {[s.tokens for s in errors]}; error events {error_s:.2f} s after the kill; "
          f"worker healthy again {restarted_s:.1f} s after it")
