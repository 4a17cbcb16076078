"""Grouped GEMM for mixture-of-experts feed-forwards on a GPU (issue 26): every expert's matmul in
one Triton launch, with no host synchronisation, so a MoE decode step can be captured in a CUDA graph.

The P = N * k (token, expert) routing pairs are numbered in token-major order (pair p = token
p // k's j-th choice, as `topk(...).flatten()` gives them). `align_pairs` lays them out by expert:

- `sorted_pairs` [max_blocks * block_m]: each expert's pairs in a run padded to a multiple of
  block_m with the sentinel P (no pair); runs follow each other in expert order;
- `block_expert` [max_blocks]: the expert of each block of block_m slots, -1 past the last run.

max_blocks = ceil(P / block_m) + E bounds the padded runs for any routing (each run adds less than
one block of padding), so every size is known without reading the routing on the host (no
`.item()`, no `bincount`, whose output size is data-dependent on CUDA).

`grouped_matmul(x, weights [E, N, K], ...)` computes out[p] = x[p // row_div] @ weights[e(p)]^T for
every pair p: row_div = k reads the token's activations (gate/up), 1 the pair's own (down). A program
owns block_m slots of one expert and block_n output columns, so its weight tile serves every pair
routed there; sentinel slots and blocks of expert -1 load nothing and store nothing.

`moe_forward` is SparseMoE's forward on these (workers/models/moe.py runs it on CUDA). Tested in
Triton's CPU interpreter; GPU speed: not measured (written on a host without a GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.expert_pairs import group_by_expert
from kernels.triton.common import dot_precision, tile_dot, upcast_dots

BLOCK_M = 16  # slots per program: tl.dot's smallest tile; decode batches route few pairs per expert


def max_blocks(num_pairs: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    return -(-num_pairs // block_m) + num_experts


def align_pairs(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) of the flat expert ids [P] of the routing pairs (see the module doc)."""
    num_pairs = experts.numel()
    device = experts.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order, sorted_experts, rank = group_by_expert(experts, counts)
    slots = max_blocks(num_pairs, num_experts, block_m) * block_m
    sorted_pairs = torch.full((slots,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[(padded_end - padded)[sorted_experts] + rank] = order
    block_starts = torch.arange(0, slots, block_m, device=device)
    owner = torch.searchsorted(padded_end, block_starts, right=True)  # num_experts past the last run
    block_expert = torch.where(owner < num_experts, owner, -1)
    return sorted_pairs, block_expert


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, row_div, N, K,
                    stride_xm, stride_we, stride_wn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    has_expert = (tl.zeros((BLOCK_M,), dtype=tl.int32) + expert) >= 0  # a vector: the interpreter takes no scalar mask
    live = (pairs < num_pairs) & has_expert  # padding slots and unused blocks do nothing
    rows = tl.where(live, pairs // row_div, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    weights = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=live[:, None] & (ks[None, :] < K), other=0.0)
        b = tl.load(weights + cols[None, :] * stride_wn + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K),
                    other=0.0)
        acc += tile_dot(a, b, PRECISION, UPCAST)
    out = out_ptr + tl.where(live, pairs, 0).to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & (cols[None, :] < N))


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
                   num_pairs: int, row_div: int, block_m: int = BLOCK_M) -> torch.Tensor:
    """out [P, N] in x's dtype: out[p] = x[p // row_div] @ weights[e(p)]^T (fp32 accumulation)."""
    if x.stride(-1) != 1 or weights.stride(-1) != 1:
        raise ValueError("the grouped GEMM needs x and the weights contiguous in their last dimension")
    n, k = weights.shape[1], weights.shape[2]
    out = torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_kernel[grid](x, weights, out, sorted_pairs, block_expert, num_pairs, row_div, n, k,
                          x.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                          PRECISION=dot_precision(x.dtype), UPCAST=upcast_dots(x.dtype))
    return out


def moe_forward(x: torch.Tensor, pair_weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, top_k: int) -> torch.Tensor:
    """SparseMoE on the grouped GEMM: x [N, H]; pair_weights, experts [N * k] (token-major);
    gate_up [E, 2I, H] ([gate; up] rows); down [E, H, I] -> [N, H] in x's dtype."""
    num_pairs = experts.numel()
    sorted_pairs, block_expert = align_pairs(experts, gate_up.shape[0])
    gate, up = grouped_matmul(x, gate_up, sorted_pairs, block_expert, num_pairs, top_k).chunk(2, dim=-1)
    y = grouped_matmul((F.silu(gate) * up).contiguous(), down, sorted_pairs, block_expert, num_pairs, 1)
    return (y * pair_weights[:, None]).view(x.shape[0], top_k, -1).sum(dim=1)
