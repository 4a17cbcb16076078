"""Speculative decoding on the default model (issue 23): fp32 greedy tokens with the ngram drafter
equal those without it, in four scheduling regimes (batched, prefix hits, chunked prefill,
preemption); drafts are accepted and rejected along the way; no block leaks afterwards."""

from __future__ import annotations

import pytest

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel
from workers.models.tokenizer import tokenizer_payload
from workers.wire.sampling import SamplingParams
from workers.wire.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow

PASSAGE = ("The gateway checks the key, the quota and the model, then hands the request to a worker. The "
           "worker keeps the prompt's blocks in its prefix cache, so the next request that shares the "
           "system prompt skips that work.")
ASKS = ["Repeat this text exactly:\n\n", "Copy the following passage word for word:\n\n",
        "Summarize in one sentence:\n\n", "What is this about?\n\n"]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
REGIMES = {
    "batched": EngineConfig(num_blocks=400),
    "prefix-hits": EngineConfig(num_blocks=400),  # run twice: the second round is served from the cache
    "chunked": EngineConfig(num_blocks=400, max_batch_tokens=48),
    "preempting": EngineConfig(num_blocks=12, block_size=16),  # 12 x 16 tokens cannot hold four ~110-token sequences
}


@pytest.fixture(scope="module")
def prompts(fp32: LoadedModel) -> list[list[int]]:
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(fp32.folder))
    return [tokenizer.encode_chat([{"role": "user", "content": ask + PASSAGE}]) for ask in ASKS]


@pytest.fixture(scope="module")
def expected(fp32: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    return [s.output_ids for s in Engine(fp32, EngineConfig(num_blocks=400)).generate_batch(prompts, GREEDY)]


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_tokens_identical_with_ngram_speculation(fp32, prompts, expected, regime: str) -> None:
    config = EngineConfig(**{**vars(REGIMES[regime]), "speculative": "ngram"})
    engine = Engine(fp32, config)
    rounds = 2 if regime == "prefix-hits" else 1
    for _ in range(rounds):
        assert [s.output_ids for s in engine.generate_batch(prompts, GREEDY)] == expected
        engine.check_integrity()
        assert engine.all_blocks_free_or_evictable()
    stats = engine.spec_stats
    assert stats.accepted_tokens > 0 and stats.accepted_tokens < stats.drafted_tokens
    if regime == "prefix-hits":
        assert engine.cache.stats().namespaces["default"]["hit_tokens"] > 0
    if regime == "preempting":
        assert engine.scheduler.preemptions > 0
