"""The default model in fp32 with a float16 KV cache (`TOLLWAY_KV_CACHE_DTYPE`): in every scheduling
regime its greedy tokens are fp32's argmax (teacher forced on the engine's own output) at >= 98% of
positions, as the bf16 bound of tests/integration/test_engine_smollm2.py; a prefix hit gives the
tokens a cold prompt gave (the cache's rounded K/V are what every read sees); no block leaks."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_engine_smollm2 import MAX_TOKENS, REGIMES, prompts  # noqa: F401 (a fixture)
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel
from workers.paged_step import prefill_logits
from workers.wire.sampling import SamplingParams

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("regime", ["chunked", "prefix-hits", "preempting"])  # batched = prefix-hits, round 1
def test_float16_cache_tracks_fp32_in_every_regime(fp32: LoadedModel, prompts: list[list[int]],  # noqa: F811
                                                   regime: str) -> None:
    base = REGIMES[regime]
    engine = Engine(fp32, EngineConfig(num_blocks=base.num_blocks, block_size=base.block_size,
                                       max_batch_tokens=base.max_batch_tokens, kv_cache_dtype="float16"))
    assert engine.runner.kv.keys[0].dtype == torch.float16
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    rounds = [engine.generate_batch(prompts, params) for _ in range(2 if regime == "prefix-hits" else 1)]
    engine.check_integrity()
    assert engine.all_blocks_free_or_evictable()
    seqs = rounds[-1]
    if regime == "prefix-hits":
        assert all(s.cached_len >= len(prompts[0]) // 2 for s in seqs)
        assert [s.output_ids for s in seqs] == [s.output_ids for s in rounds[0]]
    agree = total = 0
    for prompt, seq in zip(prompts, seqs, strict=True):
        text = prompt + seq.output_ids
        want = prefill_logits(fp32.model, [text])[0].argmax(-1)[len(prompt) - 1 : len(text) - 1]
        agree += sum(int(w) == g for w, g in zip(want.tolist(), seq.output_ids, strict=True))
        total += len(seq.output_ids)
    assert total > 0 and agree / total >= 0.98, f"{regime}: {agree}/{total} tokens are fp32's argmax"


def test_a_float16_cache_holds_twice_the_blocks(fp32: LoadedModel) -> None:
    budget = 64 * 2**20
    wide = Engine(fp32, EngineConfig(kv_budget_bytes=budget))
    narrow = Engine(fp32, EngineConfig(kv_budget_bytes=budget, kv_cache_dtype="float16"))
    assert narrow.cache.pool.num_blocks == 2 * wide.cache.pool.num_blocks
