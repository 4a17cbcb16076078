"""Mixture-of-experts routing pairs grouped by expert: the one ordering both MoE paths use (the CPU's
padded bmm's in workers/models/moe.py and the GPU's grouped GEMM in kernels/triton/moe_gemm.py).

Plain torch, no host synchronisation: sizes depend only on the number of pairs.
"""

from __future__ import annotations

import torch


def group_by_expert(experts: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, sorted_experts, rank) of the flat expert ids [P] of the routing pairs, given each expert's
    pair count [E]: `order` lists the pairs by expert (each expert's in pair order, a stable sort),
    `sorted_experts` = experts[order], and `rank[i]` is pair order[i]'s index among its expert's pairs."""
    order = experts.argsort(stable=True)
    sorted_experts = experts[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(experts.numel(), device=experts.device) - first_of_expert[sorted_experts]
    return order, sorted_experts, rank
