"""Speculative verification on the fused native decode step (issue 23): a step where every sequence
decodes, drafted ones with k tokens, runs as one-token decode rows (workers/engine/decode_rows.py).
Its rows place every token where the extend layout does; its logits and K/V equal the eager
extend step's (fp32 within summation order); through the engine greedy tokens with speculation on
equal off and no block leaks, on `native` (fused) and on `cpu` (no decode rows). Needs the native
library (tests/required.py: skipped locally without a compiler, a failure on CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.metadata import PagedAttentionMetadata
from tests.required import require_native
from tests.verification_steps import verification_both_ways
from workers.engine import decode_rows
from workers.engine.batch import ScheduledBatch
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel, load_model
from workers.models.tiny import write_tiny_model_folder
from workers.wire.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def native_ops() -> None:
    require_native()


def random_tokens(seed: int, lengths: tuple[int, ...], low: int = 3, high: int = 128) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=gen).tolist() for n in lengths]


def test_decode_rows_place_every_token_where_the_extend_layout_does() -> None:
    block_size = 4
    tables = [[7, 2, 9], [4, 1, 0, 5], [3]]
    computed, num_new = [5, 9, 0], [1, 4, 2]  # a plain decode, a draft of 3, a draft of 1 from position 0
    extend = PagedAttentionMetadata.build(num_new, [c + n for c, n in zip(computed, num_new, strict=True)],
                                          tables, block_size)
    rows = decode_rows.expand(num_new, computed, extend.block_tables, block_size, backend="native")
    assert rows.num_decodes == rows.num_seqs == 7 and rows.query_lens_list == [1] * 7
    assert rows.context_lens_list == [6, 10, 11, 12, 13, 1, 2]
    assert torch.equal(rows.positions, extend.positions)
    assert torch.equal(rows.slot_mapping, extend.slot_mapping)
    assert torch.equal(rows.block_tables[1:5], extend.block_tables[1].expand(4, -1))
    assert rows.backend == "native"
    assert decode_rows.all_decoding(num_new, [[], [8, 8, 8], [8]])
    assert not decode_rows.all_decoding([1, 4, 3], [[], [8, 8, 8], [8]])  # a prefill chunk beside them


@pytest.mark.parametrize(
    ("model_type", "dtype", "overrides"),
    [
        ("llama", torch.float32, {}),
        ("llama", torch.bfloat16, {}),
        ("qwen2", torch.float32, {}),  # q/k/v bias
        ("mistral", torch.float32, {"sliding_window": 12}),  # the window cuts each draft row's context differently
    ],
    ids=["llama-fp32", "llama-bf16", "qwen2-bias", "mistral-window"],
)
def test_fused_verification_equals_the_eager_extend_step(native_ops, tmp_path: Path, model_type: str,
                                                         dtype: torch.dtype, overrides: dict[str, int]) -> None:
    model = load_model(write_tiny_model_folder(tmp_path / "m", model_type, seed=5, **overrides), dtype).model
    prompts = random_tokens(1, (3, 17, 40, 9))
    drafts = [[], *random_tokens(2, (4, 1, 6))]  # one plain decode beside three drafts (one crosses a block)
    extend, rows = verification_both_ways(model, prompts, drafts)
    assert rows.fused and not extend.fused
    assert rows.logits.shape == extend.logits.shape == (1 + 5 + 2 + 7, model.config.vocab_size)
    close = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    torch.testing.assert_close(rows.logits, extend.logits, **close)
    if dtype == torch.float32:
        assert torch.equal(rows.logits.argmax(-1), extend.logits.argmax(-1))
    for a, b in zip([*rows.kv.keys, *rows.kv.values], [*extend.kv.keys, *extend.kv.values], strict=True):
        torch.testing.assert_close(a, b, **close)


def assert_no_leaks(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.all_blocks_free_or_evictable()
    assert not engine.sequences and not engine.has_work()


@pytest.mark.parametrize(
    ("attention", "config"),
    [
        ("native", EngineConfig(num_blocks=200)),
        ("native", EngineConfig(num_blocks=200, max_batch_tokens=16)),  # chunked prefill: some steps extend-style
        ("native", EngineConfig(num_blocks=14, block_size=8)),  # preemption
        ("cpu", EngineConfig(num_blocks=200)),  # no fused step: verification stays extend-style
    ],
    ids=["native-batched", "native-chunked", "native-preempting", "cpu"],
)
def test_engine_greedy_tokens_identical_with_fused_verification(native_ops, tiny: LoadedModel, attention: str,
                                                                config: EngineConfig) -> None:
    system = random_tokens(0, (40,), high=40)[0]  # a small alphabet: n-grams recur, drafts are proposed
    prompts = [system + tail for tail in random_tokens(3, (5, 17, 1, 30), high=40)]
    settings = {**vars(config), "attention": attention}
    off = Engine(tiny, EngineConfig(**settings))
    expected = [s.output_ids for s in off.generate_batch(prompts, GREEDY)]
    spec = Engine(tiny, EngineConfig(**{**settings, "speculative": "ngram", "speculative_tokens": 4,
                                              "speculative_timed": False}))
    batches: list[ScheduledBatch] = []
    schedule = spec.scheduler.schedule

    def recorded() -> ScheduledBatch:
        batches.append(schedule())
        return batches[-1]

    spec.scheduler.schedule = recorded  # type: ignore[method-assign]
    assert [s.output_ids for s in spec.generate_batch(prompts, GREEDY)] == expected
    assert_no_leaks(spec)
    stats = spec.spec_stats
    assert stats.drafted_tokens > 0 and 0 < stats.accepted_tokens < stats.drafted_tokens  # hits and roll-backs
    # every step that verified drafts while all its sequences decoded ran fused, plain decoders beside them included
    all_decoding = [b for b in batches if b.has_drafts and decode_rows.all_decoding(b.num_new, b.drafts)]
    assert any(len(b.seqs) > 1 and not all(b.drafts) for b in all_decoding)
    assert spec.runner.fused_verifications == (len(all_decoding) if attention == "native" else 0)
    assert off.runner.fused_verifications == 0 and len(all_decoding) > 0
    if config.num_blocks == 14:
        assert spec.scheduler.preemptions > 0
