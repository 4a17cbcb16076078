"""Gemma 2 and Gemma 3 (text): Llama-style attention and fused projections with Gemma's differences.

- embeddings scaled by sqrt(hidden) (in the weight dtype, as transformers does);
- RMSNorm multiplies by (1 + weight), rounding once after the product;
- four norms per layer: input and post-attention around attention, pre- and post-feedforward
  around the MLP (each block's output is normed before its residual add);
- GELU (tanh approximation) gating instead of SiLU;
- per-head q/k norms before RoPE (Gemma 3), attention scale query_pre_attn_scalar ** -0.5;
- per-layer types: "sliding_attention" layers use the sliding window and their own RoPE (local
  base frequency; Gemma 2 has one RoPE), "full_attention" layers attend to everything;
- optional tanh soft-capping of the final logits, and (Gemma 2) of the attention scores: only
  the torch reference attention caps, so Gemma 2 attends there (correct, slow; see dispatch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cache.kv_storage import KVStorage
from kernels.dispatch import paged_attention
from kernels.metadata import PagedAttentionMetadata
from workers.models.config import ModelConfig
from workers.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from workers.models.logits_refine import refine_top
from workers.models.rope import RotaryTable, apply_rotary


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight): the stored weight is the offset from 1."""

    def weigh(self, unit: torch.Tensor) -> torch.Tensor:
        return (unit * (1.0 + self.weight.float())).to(self.weight.dtype)


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.layer_types[layer_index] == "sliding_attention"
        self.sliding_window = config.sliding_window if self.is_sliding else None
        assert config.query_pre_attn_scalar is not None
        self.scale = config.query_pre_attn_scalar**-0.5
        self.input_norm = GemmaRMSNorm(h, eps)
        self.post_attention_norm = GemmaRMSNorm(h, eps)  # on the attention output, before the residual add
        self.pre_feedforward_norm = GemmaRMSNorm(h, eps)
        self.post_feedforward_norm = GemmaRMSNorm(h, eps)
        self.softcap = config.attn_logit_softcapping
        self.has_qk_norm = config.model_type == "gemma3_text"
        if self.has_qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_dim, eps)
            self.k_norm = GemmaRMSNorm(config.head_dim, eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.q_norm(q), self.k_norm(k)) if self.has_qk_norm else (q, k)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVStorage, meta: PagedAttentionMetadata,
    ) -> torch.Tensor:
        """Like DecoderLayer.forward, but each block's output is normed before its residual add."""
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(self.input_norm(hidden)).split(self._splits, dim=-1)
        q, k = self.normalize_qk(q.view(n, self.num_q_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        i = self.layer_index
        attn = paged_attention(q, k, v, kv.keys[i], kv.values[i], meta.for_group(kv.layout.group_of_layer[i]),
                               self.scale, self.sliding_window, self.softcap)
        hidden = hidden + self.post_attention_norm(self.o_proj(attn.reshape(n, -1))).float()
        return hidden + self.post_feedforward_norm(self.mlp(self.pre_feedforward_norm(hidden))).float()

    def mlp(self, normed: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(normed).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer
    fused_decode_ok = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cuda_graphs_ok = config.attn_logit_softcapping is None  # the reference attention syncs the host
        assert config.local_rope is not None
        self.local_rotary = RotaryTable(config.local_rope, config.head_dim, min(config.max_position_embeddings, 4096))

    def reserve_positions(self, longest: int) -> None:
        super().reserve_positions(longest)
        self.local_rotary.reserve(longest - 1, self.device)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, kv: KVStorage, meta: PagedAttentionMetadata) -> torch.Tensor:
        """As LlamaForCausalLM.hidden_states (which `forward` and prompt logprobs call): embeddings
        scaled by sqrt(hidden), sliding layers rotating with the local RoPE table."""
        if meta.block_size != kv.block_size:
            raise ValueError(f"metadata uses blocks of {meta.block_size}, the KV storage {kv.block_size}")
        last = meta.max_context_len - 1
        rotations = {False: self.rotary.gather(meta.positions, last, self.dtype),
                     True: self.local_rotary.gather(meta.positions, last, self.dtype)}
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=self.dtype)
        hidden = (self.embed_tokens(input_ids) * scale).float()
        for layer in self.layers:
            assert isinstance(layer, Gemma3DecoderLayer)
            hidden = layer(hidden, *rotations[layer.is_sliding], kv, meta)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits, tanh-capped when the config says so. As in LlamaForCausalLM.logits, with
        bf16 weights the REFINED_TOP largest of each row are recomputed in fp32 (Gemma's norm)."""
        unit = self.norm.unit(hidden)  # shared by the head's input and the exact rows below
        logits = self.lm_head(self.norm.weigh(unit))
        if self.dtype == torch.float32:
            logits = logits.float()
        else:
            exact_normed = unit * (1.0 + self.norm.weight.float())
            logits = refine_top(logits, self.lm_head.weight, exact_normed)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        remaining = dict(weights)
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, Gemma3DecoderLayer)
                p = f"model.layers.{i}."
                names = [("pre_feedforward_norm", "pre_feedforward_layernorm"),
                         ("post_feedforward_norm", "post_feedforward_layernorm")]
                if layer.has_qk_norm:
                    names += [("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm")]
                for ours, theirs in names:
                    key = f"{p}{theirs}.weight"
                    if key not in remaining:
                        raise ValueError(f"checkpoint is missing tensor {key!r}")
                    getattr(layer, ours).weight.copy_(remaining.pop(key))
        super().load_hf_state_dict(remaining)
