"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE) on the Llama / Qwen3 attention layers.

Each token is routed to its top-k experts: router logits -> softmax (fp32) over all experts ->
top-k -> renormalised to sum to 1 (Mixtral always, which equals a softmax over the top-k logits;
Qwen3-MoE when `norm_topk_prob`). Dispatch is batched: the N*k (token, expert) pairs are sorted by
expert. On the CPU, while padding stays small (`PADDED_ROWS_LIMIT`), every expert's pairs fill a
[cap, H] slab (cap: the busiest expert's count) and two `bmm`s run all experts at once (at batch 32,
8 experts, top-2: FFN 1.8-2.4x a dense model of the same active FLOPs, against 2.8-3.1x for the loop;
ops/bench/RESULTS.md); otherwise each expert that received tokens runs once on its gathered rows
(index_select, one gate/up matmul, one down matmul). Either way the weighted outputs are scattered back
with index_add_, and no Python loop runs over tokens. On CUDA the experts run instead as one Triton grouped
GEMM per projection (kernels/triton/moe_gemm.py), with no host synchronisation, so MoE models may
capture their decode steps in CUDA graphs (GPU speed not measured).

Expert weights are stacked: gate_up [E, 2I, H] ([gate; up] rows, as our dense layers fuse them)
and down [E, H, I]. Checkpoint names: Mixtral `block_sparse_moe.{gate, experts.j.w1/w3/w2}`,
Qwen3-MoE `mlp.{gate, experts.j.gate_proj/up_proj/down_proj}`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.expert_pairs import group_by_expert
from workers.models.config import ModelConfig
from workers.models.llama import DecoderLayer, LlamaForCausalLM
from workers.models.qwen3 import Qwen3DecoderLayer, take_qk_norms

PADDED_ROWS_LIMIT = 2
"""The CPU's padded path runs while its rows (experts x the busiest one's pairs) stay within this many times
the pairs; past it (many experts, skewed routing) the per-expert loop, whose rows are exactly the pairs."""


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.router = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] (weight dtype) -> [N, H]."""
        if x.shape[0] == 0:  # no tokens (a shape, known on the host): nothing to route
            return torch.zeros_like(x)
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        flat_experts = experts.flatten()  # pair p = (token p // k, expert flat_experts[p])
        if x.is_cuda:  # one grouped GEMM per projection, no host sync (capturable)
            from kernels.triton.moe_gemm import moe_forward  # Triton: loaded where it runs

            return moe_forward(x.contiguous(), weights, flat_experts, self.gate_up, self.down, self.top_k)
        num_experts, num_pairs = self.gate_up.shape[0], flat_experts.numel()
        counts = torch.bincount(flat_experts, minlength=num_experts)
        cap = int(counts.max())  # the busiest expert's pairs
        if num_experts * cap <= PADDED_ROWS_LIMIT * num_pairs:
            return self._padded(x, weights, flat_experts, counts, cap)
        return self._per_expert(x, weights, flat_experts, counts.tolist())

    def _padded(self, x: torch.Tensor, weights: torch.Tensor, flat_experts: torch.Tensor, counts: torch.Tensor,
                cap: int) -> torch.Tensor:
        """Every expert's pairs in its own `cap` rows (zeros past its count), two bmm's for all experts."""
        num_experts = self.gate_up.shape[0]
        order, sorted_experts, rank = group_by_expert(flat_experts, counts)
        slots = sorted_experts * cap + rank  # pair order[i]'s row among the experts' stacked rows
        tokens = order // self.top_k
        rows = x.new_zeros(num_experts * cap, x.shape[1])
        rows[slots] = x.index_select(0, tokens)
        gate, up = torch.bmm(rows.view(num_experts, cap, -1), self.gate_up.transpose(1, 2)).chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, self.down.transpose(1, 2)).view(num_experts * cap, -1)
        return torch.zeros_like(x).index_add_(0, tokens, y[slots] * weights[order, None])

    def _per_expert(self, x: torch.Tensor, weights: torch.Tensor, flat_experts: torch.Tensor,
                    counts: list[int]) -> torch.Tensor:
        """Each expert that received pairs runs once on its gathered rows."""
        order = flat_experts.argsort(stable=True)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // self.top_k
            gate, up = F.linear(x.index_select(0, tokens), self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[expert]) * weights[pairs, None]
            out.index_add_(0, tokens, y)
        return out

    def load(self, take: dict[str, torch.Tensor], prefix: str, style: str) -> None:
        """Pop this layer's router and experts from `take` (checkpoint names) into our stacks."""
        names = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                 "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}[style]
        block, gate_name, up_name, down_name = names

        def pop(name: str) -> torch.Tensor:
            if name not in take:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return take.pop(name)

        with torch.no_grad():
            self.router.weight.copy_(pop(f"{prefix}{block}.gate.weight"))
            for j in range(self.gate_up.shape[0]):
                e = f"{prefix}{block}.experts.{j}."
                self.gate_up[j].copy_(torch.cat([pop(f"{e}{gate_name}.weight"), pop(f"{e}{up_name}.weight")]))
                self.down[j].copy_(pop(f"{e}{down_name}.weight"))


class _MoEMixin:
    moe: SparseMoE

    def _init_moe(self, config: ModelConfig) -> None:
        del self.gate_up_proj, self.down_proj  # type: ignore[attr-defined]  # built on meta: nothing allocated
        self.moe = SparseMoE(config)

    def mlp(self, normed: torch.Tensor) -> torch.Tensor:
        return self.moe(normed)  # type: ignore[no-any-return]


class MixtralDecoderLayer(_MoEMixin, DecoderLayer):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self._init_moe(config)


class Qwen3MoeDecoderLayer(_MoEMixin, Qwen3DecoderLayer):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self._init_moe(config)


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class = MixtralDecoderLayer
    fused_decode_ok = False
    cuda_graphs_ok = True  # on CUDA the experts are one grouped GEMM: no host sync (the CPU loop is never captured)

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        remaining = dict(weights)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, MixtralDecoderLayer)
            layer.moe.load(remaining, f"model.layers.{i}.", "mixtral")
        super().load_hf_state_dict(remaining)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
    fused_decode_ok = False
    cuda_graphs_ok = True  # as Mixtral's

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        remaining = take_qk_norms(self, weights)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Qwen3MoeDecoderLayer)
            layer.moe.load(remaining, f"model.layers.{i}.", "qwen3_moe")
        super().load_hf_state_dict(remaining)
