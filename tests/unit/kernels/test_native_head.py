"""The native logits refinement (`refine_top_logits`, kernels/cpu/native/head_ops.cpp) against its
definition and against the torch path of workers/models/logits_refine.py; the native greedy choice
(`row_argmax`) against torch's `max`; the final norm's two outputs in one pass (`rms_norm_pair`,
head_ops.cpp) against the torch ops of `LlamaForCausalLM.logits`.

Needs the library built on this machine, as tests/unit/kernels/test_native.py (skipped locally without
a compiler, failing under TOLLWAY_REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import native
from tests.required import require_native
from workers.models import logits_refine


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    require_native()


def head_case(rows: int, vocab: int, hidden: int, logits_dtype: torch.dtype, weight_dtype: torch.dtype,
              seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's logits drawn apart from the weights, so a recomputed logit differs from the head's."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=generator).to(weight_dtype)
    normed = torch.randn(rows, hidden, generator=generator)
    logits = (4 * torch.randn(rows, vocab, generator=generator)).to(logits_dtype)
    return logits, weight, normed


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab", "hidden", "k"), [
    (5, 1031, 64, 64),  # fewer spans of 4W values than k: every value a candidate
    (3, 4096, 72, 1),
    (4, 8200, 32, 64),  # the threshold of the spans' maxima, and a tail past the last whole span
    (2, 40, 16, 40),
])
def test_refines_exactly_the_k_largest(logits_dtype: torch.dtype, weight_dtype: torch.dtype, rows: int, vocab: int,
                                       hidden: int, k: int) -> None:
    logits, weight, normed = head_case(rows, vocab, hidden, logits_dtype, weight_dtype, seed=vocab + k)
    out = torch.ops.tollway_cpu.refine_top_logits(logits, weight, normed, k)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    before = logits.float()
    exact = normed @ weight.float().T
    for r in range(rows):
        refined = out[r] != before[r]
        assert int(refined.sum()) == k
        torch.testing.assert_close(out[r][refined], exact[r][refined], rtol=1e-5, atol=1e-5)
        if k < vocab:  # k largest of the head's logits: none left out beats one taken (ties either way)
            assert before[r][refined].min() >= before[r][~refined].max()


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_native_and_torch_paths_agree(logits_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    logits, weight, normed = head_case(8, 1000, 96, logits_dtype, torch.bfloat16, seed=3)
    # distinct values in every row (bf16 bit patterns of 1.0 to 256), so both paths take the same k
    generator = torch.Generator().manual_seed(4)
    patterns = torch.stack([torch.randperm(1024, generator=generator)[:1000] + 0x3F80 for _ in range(8)])
    logits = patterns.to(torch.int16).view(torch.bfloat16).to(logits_dtype)
    native_out = logits_refine.refine_top(logits, weight, normed)
    monkeypatch.setattr(native, "is_loaded", lambda: False)
    torch_out = logits_refine.refine_top(logits, weight, normed)
    torch.testing.assert_close(native_out, torch_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(native_out.max(dim=-1).indices, torch_out.max(dim=-1).indices)


def test_refines_the_k_largest_among_ties_and_nans() -> None:
    generator = torch.Generator().manual_seed(7)
    rows, vocab, hidden, k = 3, 9000, 32, 64
    weight, normed = torch.randn(vocab, hidden, generator=generator), torch.randn(rows, hidden, generator=generator)
    logits = torch.randint(0, 40, (rows, vocab), generator=generator).float()  # ~225 copies of each value
    logits[1, ::97] = float("nan")  # NaNs in many spans: never refined, the spans still searched
    logits[2, 5000:] = float("-inf")
    out = torch.ops.tollway_cpu.refine_top_logits(logits, weight, normed, k)
    for r in range(rows):
        refined = (out[r] != logits[r]) & ~logits[r].isnan()
        assert int(refined.sum()) == k
        others = logits[r][~refined & ~logits[r].isnan()]
        assert logits[r][refined].min() >= others.max()


@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 1000])
def test_row_argmax_is_max_indices(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator)
    logits[1] = torch.randint(0, 3, (vocab,), generator=generator).float()  # ties: the first index
    logits[2] = float("-inf")
    logits[3, vocab // 2] = float("nan")  # a NaN is the maximum, as torch's max says
    logits[4, -1] = 1e9  # in the tail past the last whole vector
    got = torch.ops.tollway_cpu.row_argmax(logits)
    assert got.dtype == torch.long
    assert torch.equal(got, logits.max(dim=-1).indices)


def test_greedy_choice_takes_the_native_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine import sampler

    logits = torch.randn(4, 300)
    calls = []
    row_argmax = torch.ops.tollway_cpu.row_argmax
    monkeypatch.setattr(torch.ops.tollway_cpu, "row_argmax", lambda x: calls.append(x) or row_argmax(x))
    native_choice = sampler.greedy_choice(logits)
    assert len(calls) == 1
    monkeypatch.setattr(native, "is_loaded", lambda: False)
    assert torch.equal(native_choice, sampler.greedy_choice(logits))
    assert torch.equal(native_choice, logits.argmax(dim=-1))


def test_rejects_mismatched_shapes() -> None:
    logits, weight, normed = head_case(2, 100, 32, torch.float32, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="normed must be"):
        torch.ops.tollway_cpu.refine_top_logits(logits, weight, normed[:, :16].contiguous(), 8)
    with pytest.raises(RuntimeError, match="k must be"):
        torch.ops.tollway_cpu.refine_top_logits(logits, weight, normed, 101)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden"), [(32, 576), (5, 64), (3, 40)])  # 40: a tail past whole vectors
def test_rms_norm_pair_matches_the_torch_ops(weight_dtype: torch.dtype, rows: int, hidden: int) -> None:
    from workers.models.llama import RMSNorm

    generator = torch.Generator().manual_seed(rows + hidden)
    norm = RMSNorm(hidden, eps=1e-5).to(weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(hidden, generator=generator) / 4)
    x = 3 * torch.randn(rows, hidden, generator=generator)
    normed, exact = torch.ops.tollway_cpu.rms_norm_pair(x, norm.weight, norm.eps)
    unit = norm.unit(x)
    want_normed, want_exact = norm.weigh(unit), unit * norm.weight.float()
    assert normed.dtype == weight_dtype and exact.dtype == torch.float32
    # the sum of squares in another order: fp32's last bits, and where that moves a bf16 rounding, one bf16 step
    torch.testing.assert_close(exact, want_exact, rtol=1e-6, atol=1e-6)
    step = 2.0**-7 if weight_dtype == torch.bfloat16 else 1e-6
    assert ((normed.float() - want_normed.float()).abs() <= step * want_normed.float().abs() + 1e-6).all()
    if weight_dtype == torch.bfloat16:
        assert (normed == want_normed).float().mean().item() > 0.99
