"""Acceptance of the engine on the default model: fp32 greedy equals transformers' greedy token for
token in four scheduling regimes; bf16 tracks fp32; no blocks leak."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel, load_model
from workers.models.tokenizer import tokenizer_payload
from workers.paged_step import prefill_logits
from workers.precision import resolve_dtype
from workers.wire.sampling import SamplingParams
from workers.wire.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow

SYSTEM = ("You are the support assistant of tollway, a multi-tenant LLM serving platform. Answer in "
          "plain sentences, cite the relevant setting by its environment variable, and keep it short.")
QUESTIONS = ["How do I create an API key?", "Why was my request rejected with 429?",
             "What does the prefix cache do?", "Can batches be cancelled?", "Where are usage reports?"]
MAX_TOKENS = 20
REGIMES = {
    "batched": EngineConfig(num_blocks=400),
    "prefix-hits": EngineConfig(num_blocks=400),  # run twice: the second round is served from the cache
    "chunked": EngineConfig(num_blocks=400, max_batch_tokens=48),
    "preempting": EngineConfig(num_blocks=14, block_size=16),  # 14 x 16 tokens cannot hold five ~90-token sequences
}


def chat_prompts(model: LoadedModel, questions: list[str]) -> list[list[int]]:
    """Token ids of each question as a chat after the shared SYSTEM prompt."""
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(model.folder))
    return [tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in questions]


@pytest.fixture(scope="module")
def prompts(fp32: LoadedModel) -> list[list[int]]:
    return chat_prompts(fp32, QUESTIONS)


@pytest.fixture(scope="module")
def hf_greedy(smollm2_folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    outputs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
        outputs.append(out[: out.index(2)] if 2 in out else out)  # we do not emit the stop token (eos 2)
    return outputs


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_greedy_equals_transformers(fp32, prompts, hf_greedy, regime: str) -> None:
    engine = Engine(fp32, REGIMES[regime])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    rounds = 2 if regime == "prefix-hits" else 1
    for _ in range(rounds):
        seqs = engine.generate_batch(prompts, params)
        assert [s.output_ids for s in seqs] == hf_greedy
        engine.check_integrity()
        assert engine.all_blocks_free_or_evictable()
    if regime == "prefix-hits":
        assert all(s.cached_len >= len(prompts[0]) // 2 for s in seqs)
    if regime == "preempting":
        assert sum(s.num_preemptions for s in seqs) > 0


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_bf16_teacher_forced_agreement(fp32, smollm2_folder, prompts, hf_greedy) -> None:
    """Next-token argmax of bf16 vs fp32 at every position of each prompt + its fp32 continuation.
    The prompts share a system prompt; its positions are counted once, not once per prompt."""
    bf16 = load_model(smollm2_folder, torch.bfloat16)
    texts = [p + o for p, o in zip(prompts, hf_greedy, strict=True)]
    agree = total = 0
    for i, text in enumerate(texts):
        counted_from = max((shared_prefix_len(text, t) for t in texts[:i]), default=0)
        want = prefill_logits(fp32.model, [text])[0].argmax(-1)[counted_from:]
        got = prefill_logits(bf16.model, [text])[0].argmax(-1)[counted_from:]
        agree += int((want == got).sum())
        total += len(want)
    assert agree / total >= 0.98, f"bf16 agreed on {agree}/{total} next tokens"


@pytest.fixture(scope="module")
def auto(smollm2_folder: Path, fp32: LoadedModel) -> LoadedModel:
    """The model at the default precision (`auto`: bf16 where the CPU computes it faster than fp32)."""
    dtype = resolve_dtype("auto", "cpu")
    return fp32 if dtype == torch.float32 else load_model(smollm2_folder, dtype)


# The bf16 agreement is a rate: at a true 1% of near-tie flips, 87 tokens (the five questions) fail a 98%
# bound one time in five by chance alone (two flips). Measured over these 20 prompts x 48 tokens on an AMX
# host: 98.6-99.6% per regime and backend; the five questions alone gave 85/87 in one regime and 87/87 in
# another, the same code. So the bound is checked on ~900 tokens, where it separates a defect from luck.
AGREEMENT_QUESTIONS = QUESTIONS + [
    "What is continuous batching?", "How are tokens billed?", "Explain the radix cache in two sentences.",
    "Which environment variable sets the quantization?", "How do I rotate an API key?",
    "What happens when the gateway restarts?", "Write a haiku about GPUs.", "List three uses of embeddings.",
    "What is 17 times 23?", "Translate 'good morning' into French.", "Summarize the plot of Hamlet.",
    "Why is the sky blue?", "Give me a Python function that reverses a string.", "What is a mutex?",
    "Name the planets of the solar system."]
AGREEMENT_TOKENS = 48


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_default_precision_tracks_fp32_in_every_regime(fp32, auto, prompts, hf_greedy, regime: str) -> None:
    """What users run: at `auto` precision every regime's greedy tokens are fp32's argmax, teacher
    forced on the engine's own output, at >= 98% of positions (exactly, when `auto` is fp32)."""
    engine = Engine(auto, REGIMES[regime])
    if auto is fp32:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        for _ in range(2 if regime == "prefix-hits" else 1):
            seqs = engine.generate_batch(prompts, params)
            engine.check_integrity()
            assert engine.all_blocks_free_or_evictable()
        assert [s.output_ids for s in seqs] == hf_greedy
        return
    agreement_prompts = chat_prompts(fp32, AGREEMENT_QUESTIONS)
    params = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0.0)
    for _ in range(2 if regime == "prefix-hits" else 1):
        seqs = engine.generate_batch(agreement_prompts, params)
        engine.check_integrity()
        assert engine.all_blocks_free_or_evictable()
    if regime == "prefix-hits":
        assert all(s.cached_len > 0 for s in seqs)
    agree = total = 0
    for prompt, seq in zip(agreement_prompts, seqs, strict=True):
        if not seq.output_ids:
            continue
        text = prompt + seq.output_ids
        want = prefill_logits(fp32.model, [text])[0].argmax(-1)[len(prompt) - 1 : len(text) - 1]
        agree += sum(int(w) == g for w, g in zip(want.tolist(), seq.output_ids, strict=True))
        total += len(seq.output_ids)
    assert total >= 500 and agree / total >= 0.98, f"{regime}: {agree}/{total} tokens are fp32's argmax"
