"""Speculative decoding (issue 23) on the tiny random-weight model and in isolation: greedy tokens
identical with the ngram drafter on and off in every scheduling regime, drafts really verified and
rolled back without leaking a block; sampled tokens distributed as the target (chi-square), seeds
reproducing; the drafter and the table's roll-back on their own."""

from __future__ import annotations

import pytest
import torch

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from workers.engine import speculative
from workers.engine.config import EngineConfig
from workers.engine.drafter import NgramDrafter, make_drafter
from workers.engine.engine import Engine
from workers.engine.request import Sequence
from workers.paged_step import prefill_logits
from workers.wire.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}  # p = 0.001


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, 40, (40,), generator=gen).tolist()  # a small alphabet: n-grams recur
    return [system + torch.randint(3, 40, (n,), generator=gen).tolist() for n in (5, 17, 1, 30)]


def assert_no_leaks(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.all_blocks_free_or_evictable()
    assert not engine.sequences and not engine.has_work()


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(num_blocks=200),  # everything batched together
        EngineConfig(num_blocks=200, max_batch_tokens=16),  # chunked prefill beside drafted decodes
        EngineConfig(num_blocks=14, block_size=8),  # preemption: 14 blocks cannot hold all four
    ],
    ids=["batched", "chunked", "preempting"],
)
def test_greedy_tokens_identical_on_and_off(tiny, prompts, config: EngineConfig) -> None:
    off = Engine(tiny, config)
    expected = [s.output_ids for s in off.generate_batch(prompts, GREEDY)]
    spec = Engine(tiny, EngineConfig(**{**vars(config), "speculative": "ngram", "speculative_tokens": 4,
                                              "speculative_timed": False}))
    first = spec.generate_batch(prompts, GREEDY)
    assert [s.output_ids for s in first] == expected
    assert_no_leaks(spec)
    stats = spec.spec_stats
    assert stats.drafted_tokens > 0 and 0 < stats.accepted_tokens < stats.drafted_tokens  # hits and roll-backs
    again = spec.generate_batch(prompts, GREEDY)  # prefix hits on blocks committed during speculation
    assert [s.output_ids for s in again] == expected
    assert sum(s.prompt_cached_len for s in again) > 0
    assert_no_leaks(spec)
    if config.num_blocks == 14:
        assert spec.scheduler.preemptions > 0


def test_stop_strings_max_tokens_and_n_behave_as_without(tiny, prompts) -> None:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, n=n) for m, n in
              ((7, 1), (23, 2), (1, 1), (40, 3))]
    off = Engine(tiny, EngineConfig(num_blocks=200))
    spec = Engine(tiny, EngineConfig(num_blocks=200, speculative="ngram", speculative_timed=False))
    for engine in (off, spec):
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", p, sp)
    runs = []
    for engine in (off, spec):
        tokens: dict[tuple[str, int], list[int]] = {}
        finish: dict[tuple[str, int], str | None] = {}
        while engine.has_work():
            for d in engine.step():
                tokens.setdefault((d.request_id, d.index), []).extend(d.token_ids)
                if d.finish_reason is not None:
                    finish[(d.request_id, d.index)] = d.finish_reason
        runs.append((tokens, finish))
        assert_no_leaks(engine)
    assert runs[0] == runs[1]
    assert all(len(runs[1][0][(f"r{i}", 0)]) == sp.max_tokens for i, sp in enumerate(params))
    assert spec.spec_stats.drafted_tokens > 0


def test_adaptive_backoff_and_crowded_batch(tiny, prompts) -> None:
    seq = Sequence("x", [1, 2, 3], GREEDY)
    for _ in range(3):
        speculative.record(seq, 4, 0)
    assert seq.spec_cooldown == 0  # a few misses only lower the moving average
    speculative.record(seq, 4, 0)
    assert seq.spec_cooldown >= 2
    paused = seq.spec_cooldown
    assert [speculative.wants_draft(seq) for _ in range(paused + 1)] == [False] * paused + [True]
    speculative.record(seq, 4, 4)
    assert seq.spec_rate > speculative.MIN_RATE and seq.spec_cooldown == 0
    crowded = Engine(tiny, EngineConfig(num_blocks=200, speculative="ngram", speculative_max_batch=2,
                                          speculative_timed=False))
    crowded.generate_batch(prompts, GREEDY)
    assert crowded.spec_stats.drafted_tokens == 0


def test_ngram_drafter_proposes_what_followed_the_latest_match() -> None:
    drafter = NgramDrafter(max_ngram=3)
    assert drafter.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 3) == [8, 9, 1]
    assert drafter.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 1) == [8]
    # the longest n wins over a newer shorter match: [6, 7] then 2 beats the newest 7 then 3
    assert drafter.propose([6, 7, 2, 2, 7, 3, 6, 7], 1) == [2]
    assert drafter.propose([1, 2, 3, 4], 4) == []
    assert drafter.propose([4, 1, 4], 4) == [1, 4]  # a match near the end proposes what there is
    assert make_drafter("off") is None
    with pytest.raises(ValueError, match="needs TOLLWAY_DRAFT_MODEL"):
        make_drafter("draft")
    with pytest.raises(ValueError, match="must be one of off, ngram, draft"):
        make_drafter("medusa")  # type: ignore[arg-type]


def test_block_table_truncate_gives_back_blocks_wholly_beyond() -> None:
    pool = BlockPool(8, 4)
    table = BlockTable(pool)
    table.append(10)  # 3 blocks
    version = table.version
    table.truncate(5)
    assert len(table.block_ids) == 2 and table.num_tokens == 5 and table.version > version
    assert pool.num_free == 6
    table.truncate(5)
    assert len(table.block_ids) == 2
    with pytest.raises(ValueError):
        table.truncate(6)


def _chi_square(counts: dict[int, int], probs: dict[int, float], total: int) -> tuple[float, int]:
    """Statistic and degrees of freedom over the target's support (mass outside it fails outright)."""
    assert set(counts) <= {t for t, p in probs.items() if p > 0}, "a token the target never draws"
    support = [t for t, p in probs.items() if p > 0]
    stat = sum((counts.get(t, 0) - total * probs[t]) ** 2 / (total * probs[t]) for t in support)
    return stat, len(support) - 1


@pytest.mark.slow
def test_rejection_sampling_follows_the_target_distribution() -> None:
    """verify() alone: first token ~ p0 whatever the draft; given the draft's first token was
    accepted, the second ~ p1. 6-token vocabulary, 8,000 draws per case."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 1.0, 0.0, 0.7]])
    probs = logits.softmax(dim=-1)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    seq = Sequence("s", [0], params)
    seq.generator = torch.Generator().manual_seed(7)
    total = 8_000
    first: dict[int, int] = {}
    second: dict[int, int] = {}
    accepted = 0
    for _ in range(total):
        out = speculative.verify(logits, [1], seq)  # draft token 1: p0(1) ~ 0.2
        first[out[0]] = first.get(out[0], 0) + 1
        if len(out) == 2:
            accepted += 1
            second[out[1]] = second.get(out[1], 0) + 1
    p0 = dict(enumerate(probs[0].tolist()))
    stat, df = _chi_square(first, p0, total)
    assert stat < CHI2_999[df]
    stat, df = _chi_square(second, dict(enumerate(probs[1].tolist())), accepted)
    assert stat < CHI2_999[df]
    assert abs(accepted / total - p0[1]) < 0.03


@pytest.mark.slow
def test_engine_sampled_tokens_follow_the_target_and_seeds_reproduce(tiny, prompts) -> None:
    """Through the engine: the second output token (verified against a drafted guess) has the exact
    marginal sum_t1 p(t1) p(t2 | t1) under top_k=3, temperature 0.8; a seed gives the same tokens."""
    vocab = tiny.model.config.vocab_size
    prompt = prompts[1] + list(range(3, vocab))  # every token occurs: any first token gets a draft
    # 48 requests x n=16 choices, each choice its own seed (seed + index)
    params = [SamplingParams(max_tokens=3, temperature=0.8, top_k=3, seed=16 * i, n=16, ignore_eos=True)
              for i in range(48)]
    config = EngineConfig(num_blocks=1200, max_batch_tokens=4096, max_running=1000, speculative="ngram", speculative_timed=False,
                          speculative_max_batch=1000)
    engine = Engine(tiny, config)
    for i, sp in enumerate(params):
        engine.add_request(f"s{i}", prompt, sp)
    outputs: dict[tuple[str, int], list[int]] = {}
    while engine.has_work():
        for d in engine.step():
            outputs.setdefault((d.request_id, d.index), []).extend(d.token_ids)
    assert len(outputs) == 48 * 16 and all(len(o) == 3 for o in outputs.values())
    assert engine.spec_stats.verifications >= 48 * 16  # every second token went through verification
    assert_no_leaks(engine)

    def target(rows: torch.Tensor) -> torch.Tensor:
        scaled = rows / 0.8
        kth = scaled.topk(3, dim=-1).values[..., -1:]
        return scaled.masked_fill(scaled < kth, float("-inf")).softmax(dim=-1)

    p1 = target(prefill_logits(tiny.model, [prompt])[0, -1])
    marginal = torch.zeros_like(p1)
    for t1 in p1.nonzero().flatten().tolist():
        marginal += p1[t1] * target(prefill_logits(tiny.model, [prompt + [t1]])[0, -1])
    counts: dict[int, int] = {}
    for out in outputs.values():
        counts[out[1]] = counts.get(out[1], 0) + 1
    stat, df = _chi_square(counts, dict(enumerate(marginal.tolist())), len(outputs))
    assert stat < CHI2_999[df]

    again = Engine(tiny, config)
    for i, sp in enumerate(params[:4]):
        again.add_request(f"s{i}", prompt, sp)
    replay: dict[tuple[str, int], list[int]] = {}
    while again.has_work():
        for d in again.step():
            replay.setdefault((d.request_id, d.index), []).extend(d.token_ids)
    assert replay == {key: out for key, out in outputs.items() if int(key[0][1:]) < 4}
