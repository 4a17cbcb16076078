"""The soak's traffic: what one arrival sends, and the side traffic that runs beside it.

Arrival kinds, by index (see `kind_of`): streamed chats, non-streamed chats, streams the client
cancels after its first chunk (billed `client_disconnected`), half of them sharing a system prompt
so the prefix cache is exercised. Beside them, `KeyChurn` creates an API key every few seconds,
uses it, revokes it and checks the revoked key is refused (401), and `BatchFeeder` submits a small
batch now and then (its lines run at batch priority through the same gateway). Every request the
gateway admitted must end with exactly one usage row: the soak checks that with the ids collected
here. Traffic only to loopback.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field

import requests

from tests.reliability.stack import MODEL, headers

SYSTEM = "You are a terse assistant for the soak test. Answer in one short sentence. " * 4
KINDS = ("stream", "plain", "cancel", "stream", "plain", "stream")


def kind_of(i: int) -> str:
    return KINDS[i % len(KINDS)]


@dataclass
class Outcome:
    sent_at: float
    latency: float = 0.0
    status: int = 0
    error: str | None = None
    request_id: str | None = None  # the gateway's id of an admitted request (it must have one usage row)


def one_request(url: str, key: str, i: int, sent_at: float) -> Outcome:
    rng = random.Random(i)
    kind = kind_of(i)
    messages = [{"role": "user", "content": f"Question {i}: what is {rng.randrange(1000)} plus {rng.randrange(1000)}?"}]
    if i % 2 == 0:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    stream = kind != "plain"
    body = {"model": MODEL, "messages": messages, "max_tokens": 8 if kind != "cancel" else 64,
            "temperature": 0.7, "seed": i, "stream": stream}
    outcome = Outcome(sent_at)
    started = time.perf_counter()
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, headers=headers(key), stream=stream,
                           timeout=60) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = f"{response.status_code}: {response.text[:200]}"
            elif not stream:
                outcome.request_id = response.json()["id"]
            else:
                lines = []
                for line in response.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    lines.append(line)
                    if outcome.request_id is None and line != b"data: [DONE]":
                        outcome.request_id = json.loads(line[6:])["id"]
                    if kind == "cancel":
                        break  # the client hangs up after the first chunk
                if kind != "cancel" and (lines[-1] != b"data: [DONE]" or any(b'"error"' in x for x in lines)):
                    outcome.error = f"bad stream end: {lines[-2:]}"
    except requests.RequestException as exc:
        outcome.error = repr(exc)
    outcome.latency = time.perf_counter() - started
    return outcome


@dataclass
class KeyChurn:
    """Creates, uses and revokes keys of `tenant` every `interval_s` through the admin API."""

    url: str
    admin_key: str
    tenant: str
    interval_s: float = 5.0
    outcomes: list[Outcome] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    cycles: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        admin = headers(self.admin_key)
        while not self._stop.wait(self.interval_s):
            try:
                created = requests.post(f"{self.url}/admin/v1/keys", json={"tenant": self.tenant}, headers=admin,
                                        timeout=30).json()
                self.outcomes.append(one_request(self.url, created["key"], 1_000_000 + 2 * self.cycles + 1,
                                                 time.monotonic()))
                revoked = requests.post(f"{self.url}/admin/v1/keys/{created['id']}/revoke", headers=admin, timeout=30)
                refused = requests.post(f"{self.url}/v1/chat/completions", headers=headers(created["key"]),
                                        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                                        timeout=30)
                if revoked.status_code != 200 or refused.status_code != 401:
                    self.problems.append(f"revoke {revoked.status_code}, then the key got {refused.status_code}")
                self.cycles += 1
            except (requests.RequestException, KeyError, ValueError) as exc:
                self.problems.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()


@dataclass
class BatchFeeder:
    """Submits a batch of `lines` chats every `interval_s`; `finish` waits for them all."""

    url: str
    key: str
    lines: int = 5
    interval_s: float = 60.0
    batch_ids: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def submit(self) -> None:
        rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": MODEL, "max_tokens": 8,
                          "messages": [{"role": "user", "content": f"Batch line {i}: say hello."}]}}
                for i in range(self.lines)]
        data = "\n".join(json.dumps(row) for row in rows).encode()
        uploaded = requests.post(f"{self.url}/v1/files", headers=headers(self.key), files={"file": ("b.jsonl", data)},
                                 data={"purpose": "batch"}, timeout=30).json()
        batch = requests.post(f"{self.url}/v1/batches", headers=headers(self.key), timeout=30,
                              json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                    "completion_window": "24h"}).json()
        self.batch_ids.append(batch["id"])

    def run(self) -> None:
        while True:
            try:
                self.submit()
            except (requests.RequestException, KeyError, ValueError) as exc:
                self.problems.append(repr(exc))
            if self._stop.wait(self.interval_s):
                return

    def finish(self, timeout_s: float = 300.0) -> dict[str, dict]:
        """Stop submitting; wait until every batch ended; their final objects."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        ended: dict[str, dict] = {}
        while len(ended) < len(self.batch_ids) and time.monotonic() < deadline:
            for batch_id in self.batch_ids:
                if batch_id not in ended:
                    batch = requests.get(f"{self.url}/v1/batches/{batch_id}", headers=headers(self.key),
                                         timeout=30).json()
                    if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                        ended[batch_id] = batch
            time.sleep(1.0)
        return ended
