"""This gateway process's recent traffic, per second, for the built-in dashboard.

Prometheus keeps cumulative counters; the dashboard needs "the last minute" without a Prometheus
server, so `LiveStats` keeps one bucket per second for the last `HORIZON_S` seconds (requests,
errors, tokens, a capped sample of TTFTs). Adding a request is O(1); reading is O(horizon).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

HORIZON_S = 300
TTFT_SAMPLES_PER_SECOND = 64  # enough for percentiles; bounds memory under any load


@dataclass
class Bucket:
    second: int = -1
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Window:
    seconds: int
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def completion_tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds

    @property
    def cache_hit_ratio(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def _percentile(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


class LiveStats:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._buckets = [Bucket() for _ in range(HORIZON_S)]

    def _bucket(self, second: int) -> Bucket:
        bucket = self._buckets[second % HORIZON_S]
        if bucket.second != second:  # a slot from HORIZON_S seconds ago: start it afresh
            bucket.__init__(second)  # type: ignore[misc]
        return bucket

    def add_request(self, *, error: bool) -> None:
        bucket = self._bucket(int(self._clock()))
        bucket.requests += 1
        bucket.errors += error

    def add_usage(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                  ttft_s: float | None) -> None:
        bucket = self._bucket(int(self._clock()))
        bucket.prompt_tokens += prompt_tokens
        bucket.cached_tokens += cached_tokens
        bucket.completion_tokens += completion_tokens
        if ttft_s is not None and len(bucket.ttft_s) < TTFT_SAMPLES_PER_SECOND:
            bucket.ttft_s.append(ttft_s)

    def _recent(self, seconds: int) -> list[Bucket]:
        now = int(self._clock())
        return [b for b in self._buckets if now - seconds < b.second <= now]

    def window(self, seconds: int = 60) -> Window:
        seconds = max(1, min(seconds, HORIZON_S))
        buckets = self._recent(seconds)
        ttft = sorted(t for b in buckets for t in b.ttft_s)
        return Window(seconds, sum(b.requests for b in buckets), sum(b.errors for b in buckets),
                      sum(b.prompt_tokens for b in buckets), sum(b.cached_tokens for b in buckets),
                      sum(b.completion_tokens for b in buckets), _percentile(ttft, 0.5), _percentile(ttft, 0.95))

    def requests_series(self, seconds: int = 120) -> list[int]:
        """Requests per second, oldest first, the last `seconds` seconds (this second included)."""
        now = int(self._clock())
        by_second = {b.second: b.requests for b in self._recent(seconds)}
        return [by_second.get(s, 0) for s in range(now - seconds + 1, now + 1)]
