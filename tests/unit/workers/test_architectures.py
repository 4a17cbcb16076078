"""Every supported family against transformers: tiny random-weight models built with
transformers' own config classes and `save_pretrained`, with the default model's real tokenizer.
Greedy tokens through our engine (fp32) equal transformers' greedy `generate`, token for token,
past a sliding window where the family has one, and with two requests sharing a prefix."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from click.testing import CliRunner

from ops.cli import cli
from workers.engine.config import EngineConfig
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.engine import Engine
from workers.engine.runner import ModelRunner
from workers.models.config import ModelConfig, ModelConfigError
from workers.models.loader import load_model
from workers.paged_step import prefill_logits
from workers.wire.sampling import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
MOE: dict[str, Any] = dict(num_experts_per_tok=2)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3", {}),
    "qwen3-window": ("Qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    "phi3": ("Phi3", dict(sliding_window=None)),
    "phi3-window": ("Phi3", dict(sliding_window=8)),
    "mixtral": ("Mixtral", dict(num_local_experts=4, sliding_window=8, **MOE)),
    "gemma3": ("Gemma3Text", dict(sliding_window=8, num_hidden_layers=3, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                      "factor": 8.0}})),
    "gemma3-softcap": ("Gemma3Text", dict(sliding_window=8, final_logit_softcapping=3.0)),
    "gemma2": ("Gemma2", dict(sliding_window=8, num_hidden_layers=3, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=4, moe_intermediate_size=48, norm_topk_prob=False, **MOE)),
    "qwen3_moe-topk-norm": ("Qwen3Moe", dict(num_experts=4, moe_intermediate_size=48, norm_topk_prob=True, **MOE)),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights scaled so activations stay well conditioned and greedy argmaxes are far from ties."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed" in name:
                p.copy_(noise)
            elif "lm_head" in name:
                p.copy_(0.3 * noise)
            elif name.endswith("gate.weight") and "proj" not in name:  # MoE router: decisive routing
                p.copy_(noise)
            else:
                p.copy_(0.08 * noise)


def write_family(folder: Path, source: Path, prefix: str, overrides: dict[str, Any], seed: int = 0) -> Path:
    """A random-weight model of one family saved with the tokenizer files of `source` (the default model's)."""
    vocab = len(transformers.PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json")))
    config = getattr(transformers, f"{prefix}Config")(vocab_size=vocab, **{**COMMON, **overrides})
    model = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")(config).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, folder / name)
    return folder


SLOW = ("mixtral", "qwen3_moe", "qwen3_moe-topk-norm")  # > 10 s each on 2 shared cores (transformers' MoE)


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in sorted(FAMILIES)
])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_folder: Path):
    prefix, overrides = FAMILIES[request.param]
    folder = write_family(tmp_path_factory.mktemp(request.param), smollm2_folder, prefix, overrides)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                attn_implementation="eager").eval()
    return folder, load_model(folder, torch.float32), theirs


def hf_greedy(theirs, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    ids = torch.tensor([prompt])
    out = theirs.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_engine_greedy_equals_transformers_with_shared_prefix(family) -> None:
    _, loaded, theirs = family
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, loaded.model.config.vocab_size, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (3, 9)]
    expected = [hf_greedy(theirs, p, 12) for p in prompts]
    engine = Engine(loaded, EngineConfig(num_blocks=64, block_size=4))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = engine.generate_batch(prompts[:1], params)
    second = engine.generate_batch(prompts[1:], params)  # reuses the shared prefix's cached blocks
    assert second[0].cached_len >= 16
    assert [s.output_ids for s in first + second] == expected


@pytest.mark.parametrize("family", ["qwen3-window", "mixtral"], indirect=True)
def test_a_sliding_window_gives_back_the_blocks_that_left_it(family) -> None:
    """Every layer has a window of 8 (block size 4): a sequence holds at most the blocks its next
    step can see, so 100 tokens run in a 12-block cache that could not hold them whole, with the
    same tokens as transformers; the prompt's blocks stay in the tree for the next request."""
    _, loaded, theirs = family
    assert set(loaded.model.config.layer_windows) == {8}
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, loaded.model.config.vocab_size, (22,), generator=gen).tolist()
    engine = Engine(loaded, EngineConfig(num_blocks=12, block_size=4, max_batch_tokens=8))  # 3 prefill chunks
    params = SamplingParams(max_tokens=78, temperature=0.0, ignore_eos=True)
    seq = engine.add_request("long", prompt, params)
    held = []
    while engine.has_work():
        engine.step()
        engine.check_integrity()
        if seq.block_table is not None:
            held.append(len(seq.block_table.held_ids))
    assert seq.finish_reason is not None and seq.finish_reason.value == "length" and len(seq.output_ids) == 78
    assert seq.output_ids == hf_greedy(theirs, prompt, 78)
    assert max(held) <= 4 and held[-1] <= 4  # (window 8 + the token being written) spans at most 3 blocks, +1 growing
    assert engine.cache.all_free_or_evictable()
    again = engine.add_request("again", prompt + [5, 6], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert again.cached_len == 20 and again.output_ids == hf_greedy(theirs, prompt + [5, 6], 4)


@pytest.mark.parametrize("family", ["gemma3", "gemma2"], indirect=True)
def test_mixed_windows_give_back_the_sliding_layers_pages(family) -> None:
    """Sliding (window 8) and full layers: one block table per layer group over one page pool
    (block size 4, a page is one layer's block here). The sliding groups hold at most the pages
    their window needs while the full group keeps every block, so 100 tokens run in 36 pages where
    one table for all three layers would need 75 - with transformers' tokens. The prompt's blocks
    stay cached; the next request hits them as far as the sliding pages it needs are still there."""
    _, loaded, theirs = family
    assert loaded.model.config.layer_windows == (8, None, 8)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, loaded.model.config.vocab_size, (22,), generator=gen).tolist()
    engine = Engine(loaded, EngineConfig(num_blocks=36, block_size=4, max_batch_tokens=8))  # 3 prefill chunks
    assert engine.runner.kv.layout.group_windows == (None, 8, 8)
    seq = engine.add_request("long", prompt, SamplingParams(max_tokens=78, temperature=0.0, ignore_eos=True))
    held: list[list[int]] = []
    while engine.has_work():
        engine.step()
        engine.check_integrity()
        if seq.block_table is not None:
            held.append([len(t.held_ids) for t in seq.block_table.groups])
    assert seq.finish_reason is not None and seq.finish_reason.value == "length"
    assert seq.output_ids == hf_greedy(theirs, prompt, 78)
    assert max(h[1] for h in held) <= 4 and max(h[2] for h in held) <= 4 and held[-1][0] == 25
    assert engine.cache.all_free_or_evictable()
    again = engine.add_request("again", prompt + [5, 6], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    assert again.cached_len == 20 and again.output_ids == hf_greedy(theirs, prompt + [5, 6], 4)


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_mixed_windows_under_captured_decode_steps(family) -> None:
    """Decode steps by bucket in DecodeGraphs (its CPU stand-in replays the captured call on the static
    buffers): every group's tables and slots are static, padding rows use the reserved page, and
    the sliding groups still give pages back - with transformers' tokens for a batch of 3 (bucket 4)."""
    _, loaded, theirs = family
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, loaded.model.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 14, 22)]
    engine = Engine(loaded, EngineConfig(num_blocks=60, block_size=4))
    layout, backend = engine.runner.kv.layout, engine.runner.backend
    assert layout.num_groups == 3 and backend is not None
    kv = loaded.model.allocate_kv(61, 4, layout=layout)  # one more page than the pool hands out: the padding rows'
    graphs = DecodeGraphs(loaded.model, kv, 60, backend, buckets=(1, 2, 4))
    engine.runner = ModelRunner(loaded.model, kv, backend, graphs)
    outputs = engine.generate_batch(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert [s.output_ids for s in outputs] == [hf_greedy(theirs, p, 40) for p in prompts]
    assert (4, 256) in graphs.graphs and engine.cache.all_free_or_evictable()
    loaded.model.reserve_positions(5000)  # what DecodeGraphs asks of a model: both RoPE tables reach it
    assert loaded.model.rotary._cos.shape[0] >= 5000 and loaded.model.local_rotary._cos.shape[0] >= 5000


@pytest.mark.parametrize("family", ["gemma3", "gemma2"], indirect=True)
def test_mixed_windows_fork_choices_and_score_prompts(family) -> None:
    """n = 3 choices fork every group's table (the prompt's partly filled last page copied on write in
    each group) and each draws as a single request seeded seed + i would; a request scoring its
    prompt (which computes it whole, `no_match`) gets transformers' prompt logprobs (Gemma's scaled
    embeddings and local RoPE included: its `hidden_states` once fell back to Llama's)."""
    _, loaded, theirs = family
    prompt = torch.randint(3, 1000, (22,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(loaded, EngineConfig(num_blocks=80, block_size=4))
    engine.add_request("multi", prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=500, n=3, ignore_eos=True))
    engine.step()
    choices = sorted((s for s in engine.scheduler.running if s.request_id == "multi"), key=lambda s: s.index)
    while engine.has_work():
        engine.step()
        engine.check_integrity()
    for i, choice in enumerate(choices):
        single = SamplingParams(max_tokens=20, temperature=1.0, seed=500 + i, ignore_eos=True)
        [alone] = Engine(loaded, EngineConfig(num_blocks=80, block_size=4)).generate_batch([prompt], single)
        assert choice.output_ids == alone.output_ids
    assert len({tuple(c.output_ids) for c in choices}) > 1
    [scored] = engine.generate_batch([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))
    with torch.no_grad():
        expected = torch.log_softmax(theirs(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    wanted = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert scored.prompt_logprobs == pytest.approx(wanted.tolist(), abs=1e-4)  # one per prompt token after the first
    assert engine.cache.all_free_or_evictable()


class OracleDrafter:
    """Drafts the known greedy continuation with its last token wrong: each verification accepts
    some tokens and rolls the rest back (the table truncates), whatever the random model says."""

    def __init__(self, prompts: list[list[int]], expected: list[list[int]]) -> None:
        self.known = [(p, e) for p, e in zip(prompts, expected, strict=True)]

    def propose(self, token_ids, k: int, key=None) -> list[int]:
        for prompt, continuation in self.known:
            if list(token_ids[: len(prompt)]) == prompt:
                draft = continuation[len(token_ids) - len(prompt):][:k]
                return draft[:-1] + [(draft[-1] + 1) % 1000] if draft else []
        return []


@pytest.mark.parametrize("family", ["phi3-window", "gemma3"], indirect=True)
@pytest.mark.parametrize("regime", ["preempting", "speculative"])
def test_a_sliding_window_that_gives_blocks_back_keeps_the_tokens(family, regime: str) -> None:
    """Blocks given back under preemption (a 9-block cache, 30 pages for Gemma 3's three one-layer groups;
    prompts in chunks of 8: recomputed sequences hit their prompts' blocks and drop again) and under
    drafts (rejected draft tokens truncate the tables): transformers' greedy tokens either way, pool
    and tree consistent at the end."""
    _, loaded, theirs = family
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (22,), generator=gen).tolist() for _ in range(3)]
    expected = [hf_greedy(theirs, p, 30) for p in prompts]
    pages = 30 if loaded.model.config.layer_types else 9
    config = (EngineConfig(num_blocks=pages, block_size=4, max_batch_tokens=8) if regime == "preempting" else
              EngineConfig(num_blocks=64, block_size=4, speculative="ngram", speculative_timed=False))
    engine = Engine(loaded, config)
    if regime == "speculative":
        engine.drafter = OracleDrafter(prompts, expected)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert [s.output_ids for s in engine.generate_batch(prompts, params)] == expected
    engine.check_integrity()
    assert engine.cache.all_free_or_evictable()
    if regime == "preempting":
        assert engine.scheduler.preemptions > 0
    else:
        stats = engine.spec_stats
        assert 0 < stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.slow
def test_qwen3_generate_cli_equals_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                smollm2_folder: Path) -> None:
    folder = write_family(tmp_path / "qwen3", smollm2_folder, "Qwen3", {})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = "The quick brown fox jumps over the lazy dog"
    expected = tokenizer.decode(hf_greedy(theirs, tokenizer(text)["input_ids"], 8, eos=2))
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(cli, ["generate", "--model", str(folder), "--max-tokens", "8", "--dtype", "float32",
                                      text])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == expected.strip()


def test_prefill_logits_equal_transformers(family) -> None:
    """Logit values, not only argmaxes (final soft-capping is monotonic: greedy alone cannot see it)."""
    _, loaded, theirs = family
    ids = torch.randint(3, loaded.model.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(ids).logits
    assert (prefill_logits(loaded.model, ids.tolist()) - expected).abs().max().item() <= 1e-4


def test_bfloat16_tracks_float32(family) -> None:
    """bf16 weights: logits close to fp32's and nearly the same argmaxes (every family's norms and
    head, Gemma's (1 + weight) fp32 refinement included)."""
    folder, loaded, _ = family
    bf16 = load_model(folder, torch.bfloat16).model
    ids = torch.randint(3, loaded.model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))
    fp32_logits, bf16_logits = prefill_logits(loaded.model, ids.tolist()), prefill_logits(bf16, ids.tolist())
    assert (bf16_logits - fp32_logits).abs().max().item() < 0.5
    assert (bf16_logits.argmax(-1) == fp32_logits.argmax(-1)).float().mean().item() >= 0.9


def test_fused_decode_is_refused_for_other_layers(family) -> None:
    _, loaded, _ = family
    assert loaded.model.fused_decode_ok == (loaded.model.config.model_type == "phi3")
    c = loaded.model.config  # the capped reference attention syncs with the host
    assert loaded.model.cuda_graphs_ok == (c.attn_logit_softcapping is None)  # MoE: the grouped GEMM on CUDA


@pytest.mark.parametrize(("hf", "words"), [
    ({"model_type": "gemma3"}, "gemma3_text"),
    ({"model_type": "falcon"}, "'falcon' is not supported"),
    ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "'longrope'"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
])
def test_unsupported_types_and_features_are_named(hf: dict[str, Any], words: str) -> None:
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 2}
    with pytest.raises(ModelConfigError, match=words):
        ModelConfig.from_hf({**base, **hf})


def test_both_config_spellings_parse_alike() -> None:
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 2}
    moe = [ModelConfig.from_hf({**base, "model_type": "qwen3_moe", key: 4, "num_experts_per_tok": 2})
           for key in ("num_experts", "num_local_experts")]
    assert moe[0].num_experts == moe[1].num_experts == 4
    old = ModelConfig.from_hf({**base, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 2})
    new = ModelConfig.from_hf({**base, "model_type": "gemma3_text", "layer_types": list(old.layer_types),
                               "rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                      "factor": 8.0},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert old.layer_types == new.layer_types == ("sliding_attention", "full_attention")
    assert old.rope == new.rope and old.rope.scaling_type == "linear" and old.rope.theta == 1e6
    assert old.local_rope == new.local_rope and new.local_rope is not None and new.local_rope.theta == 1e4
