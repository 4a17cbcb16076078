"""The batched sampler's stages, and stop-string text handling."""

from __future__ import annotations

import pytest
import torch

from workers.engine.detokenize import OutputText
from workers.engine.request import Sequence
from workers.engine.sampler import apply_penalties, sample, truncate
from workers.wire.sampling import SamplingParams

VOCAB = 50


def seq(params: SamplingParams, prompt=(1, 2, 3), output=(), seed: int = 0) -> Sequence:
    s = Sequence("r", list(prompt), params, output_ids=list(output))
    s.generator = torch.Generator().manual_seed(seed)
    return s


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_truncations_pick_the_argmax() -> None:
    logits = logits_for(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=1),
              SamplingParams(temperature=1.5, top_p=1e-6), SamplingParams(temperature=1.5, min_p=1.0)]
    result = sample(logits, [seq(p, seed=i) for i, p in enumerate(params)])
    assert result.token_ids == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_keep_only_allowed_tokens() -> None:
    logits = logits_for(1)[0]
    ranked = logits.argsort(descending=True).tolist()
    draws = {
        "top_k": (SamplingParams(temperature=2.0, top_k=3), set(ranked[:3])),
        "top_p": (SamplingParams(temperature=1.0, top_p=0.5), None),
        "min_p": (SamplingParams(temperature=1.0, min_p=0.2), None),
    }
    probs = logits.softmax(-1)
    nucleus = set()
    mass = 0.0
    for token in ranked:  # smallest set of best tokens whose mass reaches 0.5
        nucleus.add(token)
        mass += probs[token].item()
        if mass >= 0.5:
            break
    floor = {t for t in range(VOCAB) if probs[t] >= 0.2 * probs.max()}
    draws["top_p"] = (draws["top_p"][0], nucleus)
    draws["min_p"] = (draws["min_p"][0], floor)
    for name, (params, allowed) in draws.items():
        seqs = [seq(params, seed=s) for s in range(200)]
        got = set(sample(logits.expand(200, VOCAB).clone(), seqs).token_ids)
        assert got <= allowed, name
        assert len(got) > 1 or len(allowed) == 1, name  # it really samples


def test_truncation_order_is_top_k_then_top_p_then_min_p() -> None:
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0, -1.0]])
    kept = truncate(logits, [seq(SamplingParams(top_k=2, top_p=0.99))])
    assert torch.isfinite(kept).tolist() == [[True, True, False, False, False]]


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0]])
    rep = logits.clone()
    apply_penalties(rep, [seq(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1,))])
    assert rep.tolist() == [[1.0, -4.0, 1.0, 0.5, 0.0]]  # positive divided, negative multiplied
    freq = logits.clone()
    apply_penalties(freq, [seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=(0,),
                               output=(2, 2, 3))])
    assert freq.tolist() == [[2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 0.0]]  # output only, not the prompt


def test_seeded_rows_do_not_depend_on_batch_mates() -> None:
    logits = logits_for(3, seed=5)
    params = SamplingParams(temperature=1.0)
    alone = [sample(logits[1:2], [seq(params, seed=42)]).token_ids[0] for _ in range(1)]
    mates = [seq(SamplingParams(temperature=0.7), seed=1), seq(params, seed=42), seq(SamplingParams(temperature=0.0))]
    assert sample(logits, mates).token_ids[1] == alone[0]


def test_logprobs_are_the_models() -> None:
    logits = logits_for(2)
    result = sample(logits, [seq(SamplingParams(temperature=0.0, logprobs=3)), seq(SamplingParams(temperature=0.0))])
    expected = logits.log_softmax(-1)
    assert result.logprobs is not None and result.top_logprobs is not None
    assert result.logprobs[0] == pytest.approx(expected[0].max().item())
    top = expected[0].topk(3)
    assert [t for t, _ in result.top_logprobs[0]] == top.indices.tolist()
    assert result.top_logprobs[1] == []


def test_bad_params_are_rejected() -> None:
    for bad in ({"temperature": -1}, {"top_p": 0.0}, {"top_k": -1}, {"max_tokens": -1}, {"max_tokens": 0, "n": 2},
                {"min_p": 2}, {"temperature": float("nan")}, {"stop": ("",)}, {"logprobs": 21}, {"seed": 1.5},
                {"max_tokens": True}, {"n": 2.0}, {"stop_token_ids": (1.0,)}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


class CharTokenizer:
    """One character per token id (a stub: OutputText only needs decode)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def feed(text: OutputText, s: str) -> list[tuple[str, bool]]:
    return [text.update([ord(c) for c in s[: i + 1]]) for i in range(len(s))]


def test_stop_string_is_held_back_and_never_emitted() -> None:
    text = OutputText(CharTokenizer(), stop=("END",))  # type: ignore[arg-type]
    steps = feed(text, "abENxEND")
    emitted = "".join(piece for piece, _ in steps)
    assert emitted == "abENx"
    assert [stopped for _, stopped in steps] == [False] * 7 + [True]
    assert steps[2] == ("", False) and steps[3] == ("", False)  # "E", "EN" could start "END"


def test_flush_releases_held_text_when_no_stop_came() -> None:
    text = OutputText(CharTokenizer(), stop=("END",))  # type: ignore[arg-type]
    ids = [ord(c) for c in "abEN"]
    assert "".join(p for p, _ in feed(text, "abEN")) == "ab"
    assert text.flush(ids) == "EN"


def test_incomplete_characters_wait_for_their_bytes() -> None:
    text = OutputText(CharTokenizer())  # type: ignore[arg-type]
    assert text.update([ord("a"), 0xFFFD]) == ("a", False)
    assert text.update([ord("a"), ord("é")]) == ("é", False)
