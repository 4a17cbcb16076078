"""The quota rules' shortcuts (gateway/quotas/rules.py) answer exactly as their plain definitions."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime

from gateway.quotas.rules import utc_month, window
from gateway.quotas.store import WINDOW_S


def month_by_definition(second: float) -> int:
    when = datetime.fromtimestamp(math.floor(second), UTC)
    return when.year * 100 + when.month


def window_by_definition(buckets: dict[int, int], now: float, extra: int,
                         limit: int | None) -> tuple[dict[int, int], tuple[int, float, int]]:
    kept = {s: n for s, n in buckets.items() if s >= math.floor(now) - WINDOW_S + 1}
    used = sum(kept.values())
    newest = max((s for s, n in kept.items() if n > 0), default=-1)
    if limit is None or used + extra <= limit:
        return kept, (used, 0.0, newest)
    left = used
    for second in sorted(kept):
        left -= kept[second]
        if left + extra <= limit:
            return kept, (used, second + WINDOW_S - now, newest)
    return kept, (used, -1.0, newest)


def test_utc_month_at_every_month_boundary_and_in_any_order() -> None:
    rng = random.Random(0)
    seconds = [rng.uniform(0, 4.2e9) for _ in range(5000)]
    for year in range(1970, 2101):
        for month in range(1, 13):
            first = datetime(year, month, 1, tzinfo=UTC).timestamp()
            seconds += [first - 1, first - 0.25, first, first + 0.75]
    rng.shuffle(seconds)
    for second in seconds + sorted(seconds):
        assert utc_month(second) == month_by_definition(second), second


def test_window_answers_as_its_definition() -> None:
    rng = random.Random(1)
    for case in range(3000):
        now = 1_700_000_000 + rng.random()
        seconds = rng.sample(range(math.floor(now) - 2 * WINDOW_S, math.floor(now) + 1), rng.randint(0, 70))
        # refunds can leave a bucket at 0 (or below): such a bucket is never the newest
        buckets = {s: rng.choice([0, -3, 1, 5, 40, 400]) if case % 3 == 0 else rng.randint(1, 400) for s in seconds}
        extra, limit = rng.randint(0, 500), rng.choice([None, 0, 100, 2000, 20000])
        expected_buckets, expected = window_by_definition(buckets, now, extra, limit)
        assert window(buckets, now, extra, limit) == expected
        assert buckets == expected_buckets
