"""The default model on our implementation against transformers on the same converted weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from workers.generate import SamplingParams, generate
from workers.models.loader import LoadedModel, load_model
from workers.models.tokenizer import tokenizer_payload
from workers.paged_step import prefill_logits, run_step
from workers.wire.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow

LONG_PROMPT = " ".join(
    f"Section {i}: the gateway authenticates tenant number {i * 7 % 13}, checks its quota, "
    f"tokenizes the prompt and routes it to the engine worker with the longest cached prefix."
    for i in range(29)
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "Explain in one sentence why the sky is blue.",
    LONG_PROMPT,
]


@pytest.fixture(scope="module")
def ours(smollm2_folder: Path) -> LoadedModel:
    return load_model(smollm2_folder, torch.float32)


@pytest.fixture(scope="module")
def theirs(smollm2_folder: Path):
    return AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_folder: Path):
    return AutoTokenizer.from_pretrained(smollm2_folder)


def test_long_prompt_is_about_a_thousand_tokens(ours: LoadedModel) -> None:
    assert 900 <= len(ours.tokenizer.encode(LONG_PROMPT)) <= 1200


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: p[:20])
def test_logits_match_transformers_fp32(ours: LoadedModel, theirs, prompt: str) -> None:
    ids = torch.tensor([ours.tokenizer.encode(prompt)])
    with torch.no_grad():
        expected = theirs(ids).logits
    got = prefill_logits(ours.model, ids.tolist())
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-3


def test_paged_prefix_extend_and_decode_match_full_forward(ours: LoadedModel, theirs) -> None:
    """Three sequences grow through cached prefixes, mixed decode + extend steps and decodes; every
    token's logits equal a full forward over the whole sequence (transformers, contiguous KV)."""
    texts = (LONG_PROMPT, LONG_PROMPT[:400], f"{PROMPTS[2]} {PROMPTS[3]}")
    prompts = [ours.tokenizer.encode(t) for t in texts]
    pool = BlockPool(256, block_size=16)
    kv = ours.model.allocate_kv(pool.num_blocks, pool.block_size)
    tables = [BlockTable(pool) for _ in prompts]
    done = [0] * len(prompts)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]

    def step(wanted: dict[int, int]) -> None:
        chunks = {s: min(n, len(prompts[s]) - done[s]) for s, n in wanted.items()}
        order = sorted((s for s in chunks if chunks[s] > 0), key=lambda s: chunks[s] != 1)  # decodes first
        new = [prompts[s][done[s] : done[s] + chunks[s]] for s in order]
        logits = run_step(ours.model, kv, [tables[s] for s in order], new, all_logits=True)
        for s, part in zip(order, logits.split([len(n) for n in new]), strict=True):
            got[s].append(part)
            done[s] += chunks[s]

    step({s: len(p) // 2 for s, p in enumerate(prompts)})  # prefill half of each
    step({0: 1, 1: 5, 2: 3})  # a decode beside two extends on cached prefixes
    step({0: 37, 1: 1, 2: 1})
    for _ in range(5):  # batched decodes
        step({0: 1, 1: 1, 2: 1})
    step({s: len(p) for s, p in enumerate(prompts)})  # the rest as extends
    assert done == [len(p) for p in prompts]
    for s, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = theirs(torch.tensor([prompt])).logits[0]
        assert (torch.cat(got[s]) - expected).abs().max().item() <= 1e-3


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: p[:20])
def test_greedy_64_tokens_match_transformers(ours: LoadedModel, theirs, prompt: str) -> None:
    prompt_ids = ours.tokenizer.encode(prompt)
    expected = theirs.generate(torch.tensor([prompt_ids]), max_new_tokens=64, do_sample=False)
    expected_new = expected[0, len(prompt_ids):].tolist()
    eos = set(ours.eos_token_ids)
    if any(t in eos for t in expected_new):  # transformers keeps the stop token; we do not emit it
        expected_new = expected_new[: next(i for i, t in enumerate(expected_new) if t in eos)]
    [got] = generate(ours.model, [prompt_ids], SamplingParams(max_new_tokens=64), ours.eos_token_ids)
    assert got == expected_new


def test_chat_template_and_decode_match_transformers(ours: LoadedModel, hf_tokenizer) -> None:
    messages = [{"role": "user", "content": "Name three primes."}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    gateway_tokenizer = TextTokenizer.from_payload(tokenizer_payload(ours.folder))
    assert gateway_tokenizer.encode_chat(messages) == expected
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert gateway_tokenizer.render_chat(with_system) == hf_tokenizer.apply_chat_template(
        with_system, add_generation_prompt=True, tokenize=False
    )
    ids = ours.tokenizer.encode(" Héllo,  wörld! <|im_end|>")
    assert gateway_tokenizer.encode(" Héllo,  wörld! <|im_end|>") == ids
    assert ours.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
