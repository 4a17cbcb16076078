"""Attention-logit soft-capping (Gemma 2): the reference caps scaled scores as c * tanh(s / c), and
the dispatch sends capped layers there whatever the step's backend."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.cpu import native
from kernels.dispatch import paged_attention
from kernels.metadata import Backend, PagedAttentionMetadata


def dense_capped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """Causal attention of one sequence [T, H, D] written out directly, for comparison."""
    scores = torch.einsum("thd,lhd->htl", q, k) * scale
    scores = torch.tanh(scores / cap) * cap
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    return torch.einsum("htl,lhd->thd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def test_reference_caps_scores_and_dispatch_uses_it_on_every_backend() -> None:
    gen = torch.Generator().manual_seed(0)
    t, h, d, block = 7, 2, 8, 4
    q, k, v = (torch.randn(t, h, d, generator=gen) * 3 for _ in range(3))  # large scores: the cap bites
    expected = dense_capped(q, k, v, 0.5, 2.0)
    assert (expected - dense_capped(q, k, v, 0.5, 1e6)).abs().max() > 0.05  # capping changes the output
    backends: list[Backend] = ["reference", "cpu"] + (["native"] if native.load() else [])
    for backend in backends:
        k_cache, v_cache = torch.zeros(4, block, h, d), torch.zeros(4, block, h, d)
        prefill = PagedAttentionMetadata.build([t - 1], [t - 1], [[0, 1]], block, backend=backend)
        got = paged_attention(q[:-1], k[:-1], v[:-1], k_cache, v_cache, prefill, 0.5, None, softcap=2.0)
        assert torch.allclose(got, expected[:-1], atol=1e-5), backend
        decode = PagedAttentionMetadata.build([1], [t], [[0, 1]], block, backend=backend)
        got = paged_attention(q[-1:], k[-1:], v[-1:], k_cache, v_cache, decode, 0.5, None, softcap=2.0)
        assert torch.allclose(got, expected[-1:], atol=1e-5), backend
    assert reference.attend_one_sequence(q, k, v, torch.arange(t), 0.5, None, 2.0).allclose(expected, atol=1e-5)
