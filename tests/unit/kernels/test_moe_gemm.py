"""The MoE grouped GEMM (kernels/triton/moe_gemm.py) in Triton's CPU interpreter (compiled on CUDA in
the `gpu` test): the pair layout, each grouped matmul against torch per pair, and the whole expert
feed-forward against SparseMoE's CPU path (padded bmm or per-expert loop)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.expert_pairs import group_by_expert
from kernels.triton.moe_gemm import BLOCK_M, align_pairs, grouped_matmul, max_blocks, moe_forward
from workers.models.config import ModelConfig
from workers.models.moe import SparseMoE


@pytest.mark.parametrize("experts", [
    [2, 0, 2, 1, 2, 0],            # every expert, uneven
    [3] * 20,                      # all pairs on one expert, past one block
    [0, 3, 0, 3],                  # experts 1 and 2 get nothing
    list(range(8)) * 5,            # 40 pairs over 8 experts
])
def test_pairs_are_laid_out_by_expert_in_padded_runs(experts: list[int]) -> None:
    num_experts = max(experts) + 1 if max(experts) >= 3 else 4
    flat = torch.tensor(experts)
    sorted_pairs, block_expert = align_pairs(flat, num_experts)
    num_pairs = len(experts)
    assert sorted_pairs.numel() == max_blocks(num_pairs, num_experts) * BLOCK_M == block_expert.numel() * BLOCK_M
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    blocks = sorted_pairs.view(-1, BLOCK_M)
    seen = []
    for b, owner in enumerate(block_expert.tolist()):
        slots = blocks[b][blocks[b] < num_pairs].tolist()
        if owner < 0:
            assert not slots  # unused blocks hold only padding
            continue
        assert all(experts[p] == owner for p in slots)  # one expert per block
        assert slots == sorted(slots)  # an expert's pairs in pair order
        assert (blocks[b] < num_pairs).tolist() == [True] * len(slots) + [False] * (BLOCK_M - len(slots))
        seen.append(owner)
    assert seen == sorted(seen)  # runs in expert order
    for expert in range(num_experts):
        assert seen.count(expert) == -(-experts.count(expert) // BLOCK_M)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("row_div", [1, 2])
def test_grouped_matmul_is_each_pair_s_matmul(dtype: torch.dtype, tolerance: float, row_div: int) -> None:
    """fp32: summation order only. fp16 / bf16: the output rounded once (2^-11 / 2^-8 relative) on O(1) values."""
    gen = torch.Generator().manual_seed(row_div)
    experts = torch.randint(0, 5, (22,), generator=gen)
    x = torch.randn(22 // row_div, 40, generator=gen).to(dtype)
    weights = (torch.randn(5, 24, 40, generator=gen) / 6).to(dtype)
    sorted_pairs, block_expert = align_pairs(experts, 5)
    out = grouped_matmul(x, weights, sorted_pairs, block_expert, 22, row_div)
    expected = torch.stack([x[p // row_div].float() @ weights[e].float().T for p, e in enumerate(experts.tolist())])
    assert out.dtype == dtype
    assert torch.allclose(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_grouped_matmul_accumulates_over_k_tiles_with_tails(dtype: torch.dtype, tolerance: float) -> None:
    """K = 200 (four 64-wide tiles, the last partial) and N = 100 (two column blocks, the last partial), with
    x's rows strided: a real model's hidden size runs the K loop many times, the other tests run it once."""
    gen = torch.Generator().manual_seed(11)
    experts = torch.randint(0, 6, (30,), generator=gen)
    x = torch.randn(15, 260, generator=gen).to(dtype)[:, :200]
    weights = (torch.randn(6, 100, 200, generator=gen) / 14).to(dtype)
    sorted_pairs, block_expert = align_pairs(experts, 6)
    out = grouped_matmul(x, weights, sorted_pairs, block_expert, 30, 2)
    expected = torch.stack([x[p // 2].float() @ weights[e].float().T for p, e in enumerate(experts.tolist())])
    assert torch.allclose(out.float(), expected, atol=tolerance, rtol=tolerance)


def sparse_moe(experts: int, top_k: int, seed: int) -> SparseMoE:
    config = ModelConfig.from_hf({"model_type": "mixtral", "vocab_size": 100, "hidden_size": 32,
                                  "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "num_local_experts": experts,
                                  "num_experts_per_tok": top_k})
    moe = SparseMoE(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / 4)
    return moe


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 4, 2), (5, 8, 2), (33, 4, 1), (9, 8, 2)])
def test_moe_forward_equals_the_cpu_path(tokens: int, experts: int, top_k: int) -> None:
    moe = sparse_moe(experts, top_k, seed=tokens)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(100 + tokens))
    with torch.no_grad():
        expected = moe(x)
        probs = F.softmax(moe.router(x).float(), dim=-1)
        weights, chosen = probs.topk(top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        got = moe_forward(x, weights.flatten(), chosen.flatten(), moe.gate_up, moe.down, top_k)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_moe_forward_on_cuda_equals_the_loop_on_the_cpu() -> None:
    moe = sparse_moe(8, 2, seed=3)
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = moe(x)
        got = moe.to("cuda")(x.to("cuda")).cpu()  # SparseMoE runs moe_forward on CUDA
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_moe_forward_captured_in_a_cuda_graph_follows_new_routing() -> None:
    """No host sync (sync debug mode errors on one) and fixed sizes: one capture serves any routing."""
    moe = sparse_moe(8, 2, seed=3).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(16, 32, device="cuda", generator=gen)
    weights = torch.rand(32, device="cuda", generator=gen)
    experts = torch.randint(0, 8, (32,), device="cuda", generator=gen)
    with torch.no_grad():
        moe_forward(x, weights, experts, moe.gate_up, moe.down, 2)  # compile the kernels before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(graph):
                out = moe_forward(x, weights, experts, moe.gate_up, moe.down, 2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for routing in (torch.full((32,), 5), torch.arange(32) % 3, torch.randint(0, 8, (32,))):
            experts.copy_(routing)
            x.normal_(generator=gen)
            graph.replay()
            expected = moe_forward(x, weights, experts, moe.gate_up, moe.down, 2)
            assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("routing", ["even", "one expert", "some idle"])
def test_the_cpu_s_padded_and_per_expert_paths_agree(routing: str) -> None:
    """The padded bmm path (few experts, even routing) against the per-expert loop, on the same pairs."""
    moe = sparse_moe(8, 2, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(20, 32, generator=gen)
    experts = {"even": torch.randint(0, 8, (40,), generator=gen),
               "one expert": torch.full((40,), 3),
               "some idle": torch.randint(0, 3, (40,), generator=gen) * 3}[routing]
    weights = torch.rand(40, generator=gen)
    counts = torch.bincount(experts, minlength=8)
    with torch.no_grad():
        padded = moe._padded(x, weights, experts, counts, int(counts.max()))
        looped = moe._per_expert(x, weights, experts, counts.tolist())
    assert torch.allclose(padded, looped, atol=1e-5, rtol=1e-5)


def test_a_step_with_no_tokens_routes_nothing() -> None:
    moe = sparse_moe(4, 2, seed=7)
    with torch.no_grad():
        out = moe(torch.empty(0, 32))
    assert out.shape == (0, 32)


def test_pairs_grouped_by_expert_know_their_rank_within_it() -> None:
    experts = torch.tensor([2, 0, 2, 1, 2, 0])
    order, sorted_experts, rank = group_by_expert(experts, torch.bincount(experts, minlength=4))
    assert order.tolist() == [1, 5, 3, 0, 2, 4]  # stable: each expert's pairs in pair order
    assert sorted_experts.tolist() == [0, 0, 1, 2, 2, 2]
    assert rank.tolist() == [0, 1, 0, 0, 1, 2]
