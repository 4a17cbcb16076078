"""Qwen3 (dense): the Llama layer plus an RMSNorm over each query and key head before RoPE.

Checkpoints add `self_attn.q_norm.weight` / `self_attn.k_norm.weight` [head_dim] per layer; the
rest is Llama's layout (no q/k/v bias; head_dim read from config.json, not hidden / heads).
"""

from __future__ import annotations

import torch

from workers.models.config import ModelConfig
from workers.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


def take_qk_norms(model: LlamaForCausalLM, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy each layer's q/k norm weights into `model`; returns the other tensors."""
    remaining = dict(weights)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for name in ("q_norm", "k_norm"):
                key = f"model.layers.{i}.self_attn.{name}.weight"
                if key not in remaining:
                    raise ValueError(f"checkpoint is missing tensor {key!r}")
                getattr(layer, name).weight.copy_(remaining.pop(key))
    return remaining


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer
    fused_decode_ok = False  # the fused decode has no q/k norm

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        super().load_hf_state_dict(take_qk_norms(self, weights))
