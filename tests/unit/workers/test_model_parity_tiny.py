"""Our model against transformers on tiny random-weight models of each supported family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from workers.generate import SamplingParams, generate
from workers.models.loader import load_model
from workers.paged_step import prefill_logits, run_step

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen2-bias": ("qwen2", {}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from workers.models.tiny import write_tiny_model_folder

    model_type, overrides = VARIANTS[request.param]
    folder = write_tiny_model_folder(tmp_path_factory.mktemp(request.param), model_type, seed=3, **overrides)
    ours = load_model(folder, torch.float32).model
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, theirs


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return prefill_logits(model, ids.tolist())


def test_prefill_logits_match_transformers(tiny_pair) -> None:
    ours, theirs = tiny_pair
    ids = torch.randint(3, ours.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(ids).logits
    assert (full_logits(ours, ids) - expected).abs().max().item() <= 1e-4


def test_incremental_decode_equals_full_forward(tiny_pair) -> None:
    ours, _ = tiny_pair
    ids = torch.randint(3, ours.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    expected = full_logits(ours, ids)[0]
    pool = BlockPool(8, block_size=4)  # small blocks: the prefix ends mid-block and decode crosses blocks
    kv, table = ours.allocate_kv(8, block_size=4), BlockTable(pool)
    prefix, tokens = 13, ids[0].tolist()
    logits = [run_step(ours, kv, [table], [tokens[:prefix]], all_logits=True)]
    logits.append(run_step(ours, kv, [table], [tokens[prefix:16]], all_logits=True))  # extend on a prefix
    for pos in range(16, 20):
        logits.append(run_step(ours, kv, [table], [[tokens[pos]]]))
    assert (torch.cat(logits) - expected).abs().max().item() <= 1e-4


def test_ragged_batch_matches_single_sequences(tiny_pair) -> None:
    ours, _ = tiny_pair
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, ours.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 1)]
    params = SamplingParams(max_new_tokens=12)
    batched = generate(ours, prompts, params)
    singles = [generate(ours, [p], params)[0] for p in prompts]
    assert batched == singles
    assert all(len(out) == 12 for out in batched)


def test_greedy_continuation_matches_transformers(tiny_pair) -> None:
    ours, theirs = tiny_pair
    prompt = torch.randint(3, ours.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    expected = theirs.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    [ours_out] = generate(ours, [prompt[0].tolist()], SamplingParams(max_new_tokens=16))
    assert ours_out == expected[0, 9:].tolist()


def test_bfloat16_tracks_float32(tmp_path: Path) -> None:
    from workers.models.tiny import write_tiny_model_folder

    folder = write_tiny_model_folder(tmp_path / "m")
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(5))
    fp32 = full_logits(load_model(folder, torch.float32).model, ids)
    bf16 = full_logits(load_model(folder, torch.bfloat16).model, ids)
    assert bf16.dtype == torch.float32  # logits always come back in fp32
    assert (bf16 - fp32).abs().max().item() < 0.25
    assert (bf16.argmax(-1) == fp32.argmax(-1)).float().mean().item() >= 0.9


def test_bfloat16_logits_are_exact_fp32_for_the_top_candidates(tmp_path: Path) -> None:
    """The head runs in bf16 (outputs rounded to bf16) but the REFINED_TOP largest logits of each
    row are recomputed in fp32 from the same bf16 weights: no bf16 rounding where argmax and top
    logprobs are decided."""
    from workers.models.logits_refine import REFINED_TOP
    from workers.models.tiny import write_tiny_model_folder

    model = load_model(write_tiny_model_folder(tmp_path / "m", vocab_size=256), torch.bfloat16).model
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 4
    got = model.logits(hidden)
    normed = torch.nn.functional.rms_norm(hidden, (hidden.shape[-1],), eps=model.norm.eps) * model.norm.weight.float()
    exact = normed @ model.lm_head.weight.float().T
    top = exact.topk(REFINED_TOP // 2, dim=-1).indices  # well inside the refined set
    assert torch.allclose(got.gather(1, top), exact.gather(1, top), atol=1e-4)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert (got - exact).abs().max().item() > 1e-4  # the rest really is the bf16 matmul's output
