"""Speculative decoding with a draft model on the default model (issue 23, TOLLWAY_SPECULATIVE=draft):
SmolLM2 in fp32 drafting for itself (transformers on the converted folder) gives the greedy tokens of
decoding without speculation, batched, with chunked prefill and under preemption; nearly every draft
is accepted (the draft's greedy is the model's own, up to summation order), and no block leaks."""

from __future__ import annotations

import gc

import pytest

from workers.engine.config import EngineConfig
from workers.engine.draft_model import ModelDrafter
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel
from workers.models.tokenizer import tokenizer_payload
from workers.wire.sampling import SamplingParams
from workers.wire.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow

ASKS = ["Write a short poem about the sea.", "List three facts about the Moon.",
        "Explain what a prefix cache is in two sentences.", "What is the capital of France? Answer briefly."]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
REGIMES = {
    "batched": EngineConfig(num_blocks=400),
    "chunked": EngineConfig(num_blocks=400, max_batch_tokens=24),
    "preempting": EngineConfig(num_blocks=10, block_size=16),  # 10 x 16 tokens cannot hold four ~75-token sequences
}


@pytest.fixture(scope="module")
def prompts(fp32: LoadedModel) -> list[list[int]]:
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(fp32.folder))
    return [tokenizer.encode_chat([{"role": "user", "content": ask}]) for ask in ASKS]


@pytest.fixture(scope="module")
def expected(fp32: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    return [s.output_ids for s in Engine(fp32, EngineConfig(num_blocks=400)).generate_batch(prompts, GREEDY)]


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_tokens_identical_with_the_model_as_its_own_draft(fp32, prompts, expected, regime: str) -> None:
    config = EngineConfig(**{**vars(REGIMES[regime]), "speculative": "draft", "draft_model": str(fp32.folder),
                             "speculative_timed": False})
    engine = Engine(fp32, config)
    assert isinstance(engine.drafter, ModelDrafter)
    assert [s.output_ids for s in engine.generate_batch(prompts, GREEDY)] == expected
    engine.check_integrity()
    assert engine.all_blocks_free_or_evictable()
    stats = engine.spec_stats
    assert stats.drafted_tokens > 0
    assert stats.accepted_tokens / stats.drafted_tokens > 0.9
    if regime == "preempting":
        assert engine.scheduler.preemptions > 0
    gc.collect()
    assert not engine.drafter.states
