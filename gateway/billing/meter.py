"""Metering one request: what it used, measured at the gateway, written as exactly one usage row.

A `RequestMeter` follows a request from admission to its end. The worker's final usage line is
authoritative; if the stream ends without one (the worker died), the tokens the gateway received
are billed. `finish()` hands the row to the group-commit writer and returns once it is durable:
callers await it before sending their final byte, so a client that got the end of a response was
billed for it. The row and the stored idempotent response (if any) commit in one transaction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from accounting.usage import UsageRecord
from accounting.usage_commit import StoredResponse
from accounting.usage_writer import UsageWriter
from gateway.billing.idempotency import Claim


@dataclass
class RequestMeter:
    request_id: str
    tenant_id: int
    key_id: int | None
    model: str
    prompt_tokens: int
    batch_id: str | None = None
    route: str | None = None  # chat.completions | completions | responses
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    _t0: float = field(default_factory=time.perf_counter)
    _first_token_s: float | None = None
    _last_token_s: float | None = None
    received_tokens: int = 0
    usage: dict[str, int] | None = None  # the worker's, once its last line arrived
    finish_reason: str | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)  # by choice index
    started: bool = False  # a worker began answering (its prompt was processed)
    status: str | None = None  # the usage row's status, once billed

    def observe(self, line: dict[str, Any]) -> None:
        """Account one worker line (called for every line, in order)."""
        self.started = True
        if line["token_ids"]:
            self._last_token_s = now = time.perf_counter()
            if self._first_token_s is None:
                # A joined line (non-streamed) came at the end: its first token was decode_s earlier.
                self._first_token_s = now - line.get("decode_s", 0.0)
            self.received_tokens += len(line["token_ids"])
        if line["finish_reason"] is not None:
            self.finish_reason = self.finish_reasons[line.get("index", 0)] = line["finish_reason"]
        if "usage" in line:
            self.usage = line["usage"]

    def restart(self) -> None:
        """A retry on another worker: what the failed attempt streamed is not billed."""
        self.received_tokens, self.usage, self.finish_reason, self._first_token_s = 0, None, None, None
        self._last_token_s = None
        self.finish_reasons.clear()
        self.started = False

    def _usage(self) -> dict[str, int]:
        return self.usage or {"prompt_tokens": self.prompt_tokens, "cached_tokens": 0,
                              "completion_tokens": self.received_tokens}

    def usage_so_far(self) -> dict[str, int]:
        """What is (or would be) billed: the worker's usage, else the prompt and the tokens received."""
        return self._usage()

    def ttft_s(self) -> float | None:
        return self._first_token_s - self._t0 if self._first_token_s is not None else None

    def inter_token_s(self) -> float | None:
        """Mean time between the tokens received after the first (None with fewer than two)."""
        if self._first_token_s is None or self._last_token_s is None or self.received_tokens < 2:
            return None
        return (self._last_token_s - self._first_token_s) / (self.received_tokens - 1)

    def total_tokens(self) -> int:
        """Prompt + completion tokens used so far (what the quotas settle to); 0 if no worker answered."""
        if not self.started:
            return 0
        usage = self._usage()
        return usage["prompt_tokens"] + usage["completion_tokens"]

    def record(self, status: str) -> UsageRecord:
        usage = self._usage()
        now = time.perf_counter()
        ttft = (self._first_token_s - self._t0) * 1e3 if self._first_token_s is not None else None
        return UsageRecord(
            request_id=self.request_id, tenant_id=self.tenant_id, key_id=self.key_id, model=self.model,
            prompt_tokens=usage["prompt_tokens"], cached_tokens=usage["cached_tokens"],
            completion_tokens=usage["completion_tokens"], status=status, finish_reason=self.finish_reason,
            ttft_ms=ttft, latency_ms=(now - self._t0) * 1e3, started_at=self.started_at,
            finished_at=datetime.now(UTC), batch_id=self.batch_id, route=self.route)

    async def finish(self, writer: UsageWriter, status: str, claim: Claim | None = None,
                     response: tuple[int, str, bytes] | None = None, *, inline: bool = False) -> None:
        """Write the usage row (and the idempotent response) and wait until it is durable; `inline`:
        committed on this thread if the writer is idle (`UsageWriter.try_write_now`), which blocks the
        event loop for the commit (for a caller with nothing else in flight)."""
        stored = None
        if claim is not None and response is not None:
            stored = StoredResponse(claim.tenant_id, claim.key, *response)
        record = self.record(status)
        if not (inline and writer.try_write_now(record, stored)):
            await writer.write(record, stored)
        self.status = status
