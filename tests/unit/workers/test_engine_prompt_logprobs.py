"""Prompt logprobs in the engine (workers/engine/prompt_logprobs.py) on a tiny random-weight model,
against transformers on the same folder: every prompt token after the first gets its teacher-forced
logprob and top k, in one chunk or many, through preemption, with a prompt the prefix cache holds;
max_tokens 0 is prefill only; generation beside them is unchanged."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.unit.workers.test_engine_tiny import assert_no_leaks
from workers.engine import prompt_logprobs
from workers.engine.config import EngineConfig
from workers.engine.deltas import Delta
from workers.engine.engine import Engine
from workers.engine.request import FinishReason
from workers.engine.scheduler import Scheduler
from workers.models.loader import LoadedModel, load_model
from workers.wire.sampling import SamplingParams

PREFILL_ONLY = SamplingParams(max_tokens=0, prompt_logprobs=5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.models.tiny import write_tiny_model_folder

    return write_tiny_model_folder(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=3)


@pytest.fixture(scope="module")
def tiny(folder: Path) -> LoadedModel:
    return load_model(folder, torch.float32)


@pytest.fixture(scope="module")
def reference(folder: Path):
    """Teacher-forced log-softmax [P, V] of a prompt, by transformers."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()

    def log_softmax(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)

    return log_softmax


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[Delta]]:
    """Every delta of each request, run together to the end."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    deltas: dict[str, list[Delta]] = {request_id: [] for request_id in requests}
    while engine.has_work():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    return deltas


def assert_matches_reference(delta: Delta, prompt: list[int], expected: torch.Tensor, k: int) -> None:
    """delta's prompt logprobs are the teacher-forced ones: token i + 1 at position i, and the top k."""
    assert delta.prompt_logprobs is not None and delta.prompt_top_logprobs is not None
    assert len(delta.prompt_logprobs) == len(delta.prompt_top_logprobs) == len(prompt) - 1
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor(delta.prompt_logprobs), want, atol=1e-4)
    top_values, top_ids = expected[:-1].topk(k, dim=-1)
    for position, top in enumerate(delta.prompt_top_logprobs):
        assert [t for t, _ in top] == top_ids[position].tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in top]), top_values[position], atol=1e-4)


@pytest.mark.parametrize(
    "config",
    [EngineConfig(num_blocks=200), EngineConfig(num_blocks=200, max_batch_tokens=16)],
    ids=["one-chunk", "chunked"],
)
def test_prefill_only_gives_the_teacher_forced_logprobs(tiny, reference, prompts, config: EngineConfig) -> None:
    engine = Engine(tiny, config)
    deltas = run(engine, {f"r{i}": (p, PREFILL_ONLY) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        [only] = deltas[f"r{i}"]  # max_tokens 0: one delta, no token, "length", with usage
        assert only.token_ids == [] and only.text == "" and only.finish_reason == "length"
        assert only.usage == {"prompt_tokens": len(prompt), "cached_tokens": 0, "completion_tokens": 0}
        assert only.logprobs is None
        assert_matches_reference(only, prompt, reference(prompt), 5)
    assert_no_leaks(engine)


def test_a_chunk_longer_than_a_slice_is_reduced_slice_by_slice(tiny, reference, prompts, monkeypatch) -> None:
    monkeypatch.setattr(prompt_logprobs, "SLICE_ROWS", 7)  # 69 positions in 10 slices of logits
    prompt = prompts[3]
    [only] = run(Engine(tiny, EngineConfig(num_blocks=200)), {"r": (prompt, PREFILL_ONLY)})["r"]
    assert_matches_reference(only, prompt, reference(prompt), 5)


def test_a_cached_prompt_is_recomputed_for_its_logprobs(tiny, reference, prompts) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200, block_size=8))
    prompt, plain = prompts[3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run(engine, {"plain": (prompt, plain)})
    [echo] = run(engine, {"echo": (prompt, PREFILL_ONLY)})["echo"]
    assert echo.usage is not None and echo.usage["cached_tokens"] == 0  # recomputed, billed as computed
    assert_matches_reference(echo, prompt, reference(prompt), 5)
    again = engine.add_request("again", prompt, plain)
    while engine.has_work():
        engine.step()
    assert again.prompt_cached_len >= 64  # the cache still serves the prompt's 8 whole blocks to others
    assert_no_leaks(engine)


def test_generation_beside_prompt_logprobs_is_unchanged(tiny, reference, prompts, monkeypatch) -> None:
    """Greedy and seeded n > 1 choices sample the same tokens with or without prompt logprobs; the
    prompt's come once, on choice 0's first delta; a preemption in the middle of a chunked prefill
    (14 blocks of 8 for five requests, 16-token steps) drops an incomplete set, recomputed from 0."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=5, n=2, logprobs=2, ignore_eos=True)
    plain = run(Engine(tiny, EngineConfig(num_blocks=200)),
                {f"g{i}": (p, greedy) for i, p in enumerate(prompts)} | {"s": (prompts[1], seeded)})
    preempted_incomplete = []
    preempt = Scheduler.preempt

    def recording_preempt(self: Scheduler, seq) -> None:
        preempted_incomplete.append(seq.needs_prompt_logprobs)
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "preempt", recording_preempt)
    engine = Engine(tiny, EngineConfig(num_blocks=14, block_size=8, max_batch_tokens=16))
    asking = run(engine, {f"g{i}": (p, replace(greedy, prompt_logprobs=3)) for i, p in enumerate(prompts)}
                 | {"s": (prompts[1], replace(seeded, prompt_logprobs=1))})
    assert any(preempted_incomplete)
    for request_id, deltas in asking.items():
        for index in {d.index for d in deltas}:
            tokens = [t for d in deltas if d.index == index for t in d.token_ids]
            assert tokens == [t for d in plain[request_id] if d.index == index for t in d.token_ids]
        with_prompt = [d for d in deltas if d.prompt_logprobs is not None]
        assert len(with_prompt) == 1 and with_prompt[0].index == 0 and with_prompt[0].token_ids
        prompt = prompts[1] if request_id == "s" else prompts[int(request_id[1:])]
        assert_matches_reference(with_prompt[0], prompt, reference(prompt), 1 if request_id == "s" else 3)
    assert asking["s"][-1].usage is not None and asking["s"][-1].usage["completion_tokens"] == 12
    assert_no_leaks(engine)


def test_recomputed_blocks_never_strand_a_lone_sequence(tiny, prompts) -> None:
    """Recomputing sequences keep their blocks out of the tree while they run: committed below the
    cached copy of the shared 40-token prefix (held by no one, counted evictable, not evictable),
    they left a lone 82-token sequence unable to grow in 12 blocks, finished early with `length`."""
    engine = Engine(tiny, EngineConfig(num_blocks=12, block_size=8))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    deltas = run(engine, {f"g{i}": (p, params) for i, p in enumerate(prompts)})
    assert [sum(len(d.token_ids) for d in ds) for ds in deltas.values()] == [12] * len(prompts)
    assert_no_leaks(engine)


def test_prompt_logprobs_zero_gives_no_alternatives(tiny, reference, prompts) -> None:
    [only] = run(Engine(tiny, EngineConfig(num_blocks=200)),
                 {"r": (prompts[0], SamplingParams(max_tokens=0, prompt_logprobs=0))})["r"]
    assert only.prompt_top_logprobs == [[] for _ in prompts[0][1:]]
    want = reference(prompts[0])[torch.arange(len(prompts[0]) - 1), torch.tensor(prompts[0][1:])]
    assert torch.allclose(torch.tensor(only.prompt_logprobs), want, atol=1e-4)


def test_prefill_only_may_fill_the_context(tiny) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=200, max_context=32))
    full = list(range(3, 35))  # 32 tokens: no room for a token, none asked for
    [only] = run(engine, {"r": (full, PREFILL_ONLY)})["r"]
    assert only.finish_reason == "length" and len(only.prompt_logprobs or []) == 31
    with pytest.raises(ValueError, match="context holds 32"):
        engine.add_request("x", full, SamplingParams(max_tokens=1))
    assert_no_leaks(engine)


def test_a_single_token_prompt_has_no_prompt_logprobs(tiny) -> None:
    [only] = run(Engine(tiny, EngineConfig(num_blocks=20)), {"r": ([7], PREFILL_ONLY)})["r"]
    assert only.prompt_logprobs == [] and only.finish_reason == FinishReason.LENGTH.value


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_tokens": -1}, "max_tokens must be at least 0"),
    ({"max_tokens": 0, "n": 2}, "max_tokens 0"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be in"),
    ({"prompt_logprobs": True}, "prompt_logprobs must be an integer"),
])
def test_bad_sampling_params_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
