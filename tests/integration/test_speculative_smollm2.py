"""Speculative decoding on the default model (issue 23): fp32 greedy tokens with the ngram drafter
equal those without it, in four scheduling regimes (batched, prefix hits, chunked prefill,
preemption), verification running on the fused native decode step where the native ops exist;
drafts are accepted and rejected along the way; no block leaks afterwards. A verification step as
fused decode rows gives the eager extend step's logits and K/V (fp32, within summation order)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ops.offline
from kernels.cpu import native
from ops.cli import cli
from tests.required import unavailable
from tests.verification_steps import verification_both_ways
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
    config = EngineConfig(**{**vars(REGIMES[regime]), "speculative": "ngram", "speculative_timed": False})
    engine = Engine(fp32, config)
    rounds = 2 if regime == "prefix-hits" else 1
    for _ in range(rounds):
        assert [s.output_ids for s in engine.generate_batch(prompts, GREEDY)] == expected
        engine.check_integrity()
        assert engine.all_blocks_free_or_evictable()
    stats = engine.spec_stats
    assert stats.accepted_tokens > 0 and stats.accepted_tokens < stats.drafted_tokens
    assert engine.runner.fused_verifications > 0 or not native.load()  # `auto` attention is native where it loads
    if regime == "prefix-hits":
        assert engine.cache.stats().namespaces["default"]["hit_tokens"] > 0
    if regime == "preempting":
        assert engine.scheduler.preemptions > 0


def test_fused_verification_step_equals_the_eager_extend_step(fp32, prompts) -> None:
    if not native.load():
        unavailable(str(native.unavailable_reason()))
    # a plain decode, a draft copied from the prompt, a 1-token draft, a long draft crossing blocks
    drafts = [[], prompts[1][-40:-36], prompts[2][20:21], prompts[3][5:12]]
    extend, rows = verification_both_ways(fp32.model, prompts, drafts, block_size=16)
    assert rows.fused and not extend.fused
    assert rows.logits.shape[0] == len(prompts) + sum(len(d) for d in drafts)
    torch.testing.assert_close(rows.logits, extend.logits, atol=5e-4, rtol=1e-5)  # measured: 6e-5 of |logits| <= 40
    assert torch.equal(rows.logits.argmax(-1), extend.logits.argmax(-1))
    for a, b in zip([*rows.kv.keys, *rows.kv.values], [*extend.kv.keys, *extend.kv.values], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_tollway_generate_prints_the_same_text_with_speculation(model_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tollway generate` (fp32, greedy) with TOLLWAY_SPECULATIVE=ngram prints what it prints without;
    the engine it built did verify drafts (so the test cannot pass with speculation silently off)."""
    engines: list[Engine] = []

    class Recorded(Engine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(ops.offline, "Engine", Recorded)
    monkeypatch.setenv("TOLLWAY_HOME", str(model_home))
    args = ["generate", "--chat", "--temperature", "0", "--dtype", "float32", "--max-tokens", "48", ASKS[0] + PASSAGE]
    texts = {}
    for mode in ("off", "ngram"):
        monkeypatch.setenv("TOLLWAY_SPECULATIVE", mode)
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        texts[mode] = result.stdout
    assert texts["ngram"] == texts["off"] and texts["off"].strip()
    stats = engines[-1].spec_stats
    assert engines[-1].config.speculative == "ngram" and stats.verifications > 0 and stats.accepted_tokens > 0
