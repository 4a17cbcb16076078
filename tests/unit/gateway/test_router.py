"""Cache-aware worker choice: the prefix index and the SGLang-style routing rule."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest

from gateway.upstream.router import NoWorkerError, PrefixIndex, Router


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49_152) for _ in range(n)]


def test_match_counts_whole_chunks_per_worker() -> None:
    index = PrefixIndex(chunk_size=4)
    prompt = tokens(1, 20)
    index.insert("t", "a", prompt)
    index.insert("t", "b", prompt[:9])  # two whole chunks; the partial third is not indexed
    assert index.match("t", prompt) == {"a": 20, "b": 8}
    assert index.match("t", prompt[:7] + [0] * 13) == {"a": 4, "b": 4}
    assert index.match("t", [7] + prompt[1:]) == {}
    assert index.match("t", prompt[:3]) == {}  # shorter than a chunk
    index.check_integrity()


def test_namespaces_never_share_entries() -> None:
    index = PrefixIndex(chunk_size=4)
    prompt = tokens(2, 40)
    index.insert("tenant-a", "w1", prompt)
    assert index.match("tenant-b", prompt) == {}
    router = Router(index=index)
    # tenant-b's identical prompt is no hit: with equal loads it goes to the emptier index.
    assert router.choose("tenant-b", prompt, {"w1": 0, "w2": 0}) == "w2"
    assert index.match("tenant-a", prompt) == {"w1": 40}
    assert index.match("tenant-b", prompt) == {"w2": 40}


def test_longest_match_wins_under_balanced_load() -> None:
    router = Router(cache_threshold=0.5, index=PrefixIndex(chunk_size=4))
    system = tokens(3, 64)
    router.index.insert("t", "w1", system[:16])
    router.index.insert("t", "w2", system)
    loads = {"w1": 0, "w2": 3, "w3": 1}  # balanced under the default thresholds (32, 1.1)
    assert router.choose("t", system + tokens(4, 16), loads) == "w2"


def test_below_the_cache_threshold_goes_to_the_least_loaded() -> None:
    router = Router(cache_threshold=0.5, index=PrefixIndex(chunk_size=4))
    prompt = tokens(5, 100)
    router.index.insert("t", "w2", prompt[:40])  # 40% of the prompt
    assert router.choose("t", prompt, {"w1": 1, "w2": 2, "w3": 1}) == "w1"  # load tie -> emptier index, name
    assert router.index.match("t", prompt)["w1"] == 100  # the choice was recorded


def test_imbalanced_load_goes_to_the_least_loaded() -> None:
    router = Router(balance_abs_threshold=4, balance_rel_threshold=1.5, index=PrefixIndex(chunk_size=4))
    prompt = tokens(6, 64)
    router.index.insert("t", "hot", prompt)
    assert router.choose("t", prompt, {"hot": 10, "cold": 5}) == "cold"  # 10 - 5 > 4 and 10 > 1.5 * 5
    router.forget_worker("cold")  # it was recorded for the prompt it just got
    # Either condition alone is not imbalance: the cache match wins.
    assert router.choose("t", prompt, {"hot": 10, "cold": 7}) == "hot"  # gap 3 <= 4
    assert router.choose("t", prompt, {"hot": 50, "cold": 40}) == "hot"  # 50 <= 1.5 * 40


def test_unhealthy_workers_are_never_chosen() -> None:
    router = Router(index=PrefixIndex(chunk_size=4))
    prompt = tokens(7, 64)
    router.index.insert("t", "dead", prompt)
    assert router.choose("t", prompt, {"alive": 5, "other": 6}) == "alive"
    router.forget_worker("dead")
    assert "dead" not in router.index.match("t", prompt)
    assert router.index.workers() == ["alive"]
    router.index.check_integrity()


def test_no_worker_is_a_clear_error() -> None:
    with pytest.raises(NoWorkerError, match="no healthy engine worker"):
        Router().choose("t", [1, 2, 3], {})


def test_ties_are_deterministic() -> None:
    router = Router(index=PrefixIndex(chunk_size=4))
    assert router.choose("t", [], {"b": 0, "a": 0}) == "a"
    prompt = tokens(8, 32)
    router.index.insert("t", "b", prompt)
    router.index.insert("t", "c", prompt)
    assert router.choose("t", prompt, {"a": 0, "b": 2, "c": 1}) == "c"  # equal match: lower load
    assert router.choose("t", prompt, {"a": 0, "b": 1, "c": 1}) == "b"  # then name


@pytest.mark.parametrize(("value", "kwargs"), [
    ("cache_threshold", {"cache_threshold": 1.5}),
    ("balance_rel_threshold", {"balance_rel_threshold": 0.5}),
    ("balance_abs_threshold", {"balance_abs_threshold": -1}),
])
def test_bad_settings_are_rejected(value: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=value):
        Router(**kwargs)


def test_eviction_keeps_memory_bounded_and_drops_lru_first() -> None:
    index = PrefixIndex(chunk_size=8, max_tokens_per_worker=256)
    shared = tokens(9, 64)
    for i in range(50):
        index.insert("t", "w", shared + tokens(100 + i, 64))
        index.insert("u", "w", tokens(200 + i, 32))
        index.insert("t", "v", tokens(300 + i, 16))
        assert index.tokens("w") <= 256 and index.tokens("v") <= 256
        index.check_integrity()
    # The most recent prompts survive whole; the oldest are gone.
    assert index.match("t", shared + tokens(149, 64)) == {"w": 128}
    assert index.match("t", shared + tokens(100, 64)).get("w", 0) <= 64
    assert index.match("t", tokens(349, 16)) == {"v": 16}
    assert index.match("t", tokens(300, 16)) == {}
    index.remove_worker("w")
    index.remove_worker("v")
    index.check_integrity()
    assert index.workers() == [] and index.match("t", shared) == {} and index._roots == {}


def test_a_prompt_larger_than_the_bound_keeps_its_lru_prefix() -> None:
    index = PrefixIndex(chunk_size=4, max_tokens_per_worker=16)
    prompt = tokens(10, 40)
    index.insert("t", "w", prompt)
    assert index.tokens("w") == 16 and index.match("t", prompt) == {"w": 16}  # leaves go first
    index.check_integrity()


def test_simulation_system_prompts_stick_to_their_first_worker() -> None:
    rng = random.Random(42)
    router = Router()  # SGLang defaults; 16-token chunks
    systems = [tokens(1000 + i, 300) for i in range(4)]
    loads = {"w0": 0, "w1": 0}
    in_flight: deque[tuple[int, str]] = deque()  # (arrival number it finishes at, worker)
    first: dict[int, str] = {}
    sticky, later = 0, 0
    for arrival in range(400):
        while in_flight and in_flight[0][0] <= arrival:  # finishes after a few others arrive
            loads[in_flight.popleft()[1]] -= 1
        which = rng.randrange(4)
        prompt = systems[which] + [rng.randrange(49_152) for _ in range(30)]
        worker = router.choose("tenant", prompt, loads)
        loads[worker] += 1
        in_flight.append((arrival + rng.randint(2, 5), worker))
        in_flight = deque(sorted(in_flight))
        if which not in first:
            first[which] = worker
        else:
            later += 1
            sticky += worker == first[which]
    assert sticky / later >= 0.9
    assert set(Counter(first.values())) == {"w0", "w1"}  # new prompts spread over both workers
    router.index.check_integrity()
