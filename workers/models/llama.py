"""Our Llama-family causal LM (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU.

Weights keep Hugging Face names on load but are fused for speed: q/k/v become one projection and
gate/up another, so each layer runs four matmuls. A step is a flat batch of new tokens from any
mix of sequences (prefill chunks and decodes); their K/V live in paged blocks (`cache.KVStorage`)
and attention is the single `kernels.dispatch.paged_attention` call. Norms and the residual
stream run in fp32 whatever the weight dtype; matmuls and attention run in the weight dtype (in
bf16 this halves the teacher-forced disagreements with fp32 against a bf16 residual).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from cache.kv_layout import KVLayout
from cache.kv_storage import KVStorage
from kernels.cpu import native
from kernels.dispatch import paged_attention
from kernels.metadata import PagedAttentionMetadata
from workers.models import fused_decode
from workers.models.config import ModelConfig
from workers.models.logits_refine import refine_top
from workers.models.quantized_head import head_approximates
from workers.models.rope import RotaryTable, apply_rotary

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""A layer's attention: (q [N, Hq, D], k, v [N, Hkv, D]) -> [N, Hq, D], storing the new K/V."""

FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
"""Each decoder layer's four projections and the Hugging Face weights they stack, in row order."""


def fused_weight(weights: dict[str, torch.Tensor], layer: int, projection: str) -> torch.Tensor:
    """The [out, in] weight of one fused projection from Hugging Face-named `weights` (left as they are)."""
    parts = [weights[f"model.layers.{layer}.{part}.weight"] for part in FUSED_PROJECTIONS[projection]]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weigh(self.unit(x))

    def unit(self, x: torch.Tensor) -> torch.Tensor:
        """x scaled to unit RMS, in fp32 (before the weight)."""
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)

    def weigh(self, unit: torch.Tensor) -> torch.Tensor:
        """The weight times `unit` rounded to the weight's dtype: forward's result."""
        return self.weight * unit.to(self.weight.dtype)


def native_final_norm(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `LlamaForCausalLM.logits` takes its final norm's two outputs from the native op: fp32 hidden
    states on a CPU whose native ops are loaded, an fp32 or bf16 weight."""
    return (hidden.device.type == "cpu" and hidden.dtype == torch.float32 and hidden.dim() == 2
            and hidden.is_contiguous() and weight.dtype in native.DTYPES and native.is_loaded())


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_q_heads = config.num_q_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_window
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self._splits = (config.q_size, config.kv_size, config.kv_size)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVStorage,
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            i = self.layer_index
            return paged_attention(q, k, v, kv.keys[i], kv.values[i], meta.for_group(kv.layout.group_of_layer[i]),
                                   self.scale, self.sliding_window)

        return self.forward_with(hidden, cos, sin, attend)

    def forward_with(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """`forward` with the attention given: attend(q [N, Hq, D], k, v [N, Hkv, D]) stores the new
        K/V and returns [N, Hq, D] (the compiled decode step attends over fixed-shape tables)."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(self.input_norm(hidden)).split(self._splits, dim=-1)
        q, k = self.normalize_qk(q.view(num_tokens, self.num_q_heads, self.head_dim),
                                 k.view(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = attend(q, k, v)
        hidden = hidden + self.o_proj(attn.reshape(num_tokens, -1)).float()
        return hidden + self.mlp(self.post_attention_norm(hidden)).float()

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q [N, Hq, D] / k [N, Hkv, D] before RoPE: none here (Qwen3 overrides)."""
        return q, k

    def mlp(self, normed: torch.Tensor) -> torch.Tensor:
        """The feed-forward block on normed hidden states (MoE layers override)."""
        gate, up = self.gate_up_proj(normed).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [N], kv, meta) -> logits (fp32); see `forward`."""

    layer_class: type[DecoderLayer] = DecoderLayer  # families with other layers override (see registry)
    fused_decode_ok = True  # fused_decode covers exactly this class's layers
    cuda_graphs_ok = True  # forward has no host synchronisation (MoE's routing does)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryTable(config.rope, config.head_dim, min(config.max_position_embeddings, 4096))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def allocate_kv(self, num_blocks: int, block_size: int = 16, dtype: torch.dtype | None = None,
                    layout: KVLayout | None = None) -> KVStorage:
        """K/V storage for this model; dtype: the cache's (None: the model's; workers/precision.py
        `resolve_kv_cache_dtype` says which others a model may use); layout: its layer groups (None:
        one, every block id a block of every layer)."""
        c = self.config
        return KVStorage(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype or self.dtype,
                         self.device, layout)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        kv: KVStorage,
        meta: PagedAttentionMetadata,
        logit_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run a step's new tokens [N] through the model, writing their K/V into `kv`.

        `meta` places each token (position, slot, sequence). logit_indices: flat indices of the
        tokens whose logits are wanted (e.g. each sequence's last new token) -> [len, V]; None
        returns logits for every token ([N, V]).
        """
        hidden = self.hidden_states(input_ids, kv, meta)
        if logit_indices is not None:
            hidden = hidden[logit_indices]
        return self.logits(hidden)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, kv: KVStorage, meta: PagedAttentionMetadata) -> torch.Tensor:
        """The final hidden states [N, H] (fp32, before the last norm) of a step's new tokens, their
        K/V written into `kv`; `logits` turns any rows of them into logits."""
        if meta.block_size != kv.block_size:
            raise ValueError(f"metadata uses blocks of {meta.block_size}, the KV storage {kv.block_size}")
        cos, sin = self.rotary.gather(meta.positions, meta.max_context_len - 1, self.dtype)
        if fused_decode.can_fuse_layers(self, meta, kv.keys[0].dtype):  # on the native CPU ops
            hidden = fused_decode.step_hidden(self, input_ids, kv, meta, cos, sin)
        else:
            hidden = self.embed_tokens(input_ids).float()  # the residual stream stays fp32
            for layer in self.layers:
                hidden = layer(hidden, cos, sin, kv, meta)
        return hidden

    def reserve_positions(self, longest: int) -> None:
        """Make the rotary tables hold positions 0 .. longest - 1 now, on the model's device, so that
        no later step rebuilds (moves) them: a captured step reads them where they were at capture."""
        self.rotary.reserve(longest - 1, self.device)

    # -- ranks: a model sharded over processes (workers/parallel/model.py) overrides these two ------
    def announce_captured_step(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, dummy_block: int) -> None:
        """A captured decode step (workers/engine/cuda_graphs.py) is about to be captured or replayed
        for this all-decode step: other ranks must do the same. One process: nothing to tell."""

    def unannounced(self) -> AbstractContextManager[None]:
        """Within: this model's calls are not announced to other ranks (a captured step's body)."""
        return nullcontext()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of fp32 hidden states [n, H] -> [n, V].

        With bf16 weights the head matmul runs in bf16, which rounds its outputs to bf16: logits of
        magnitude 16-32 land on steps of 0.125, enough to flip near-tie argmaxes (measured: 3 of 59
        positions of a chat prompt). So the REFINED_TOP largest logits of each row are recomputed
        in fp32 (their weight rows upcast: [n, k, H], cheap) and written back: the argmax, the top
        logprobs and nearly all the probability mass are then exact, with no fp32 copy of the head.
        The same refinement makes a quantized model's int8 head (workers/models/quantized_head.py)
        exact where it matters, in fp32 too.
        """
        if native_final_norm(hidden, self.norm.weight):  # both in one native pass (head_ops.cpp rms_norm_pair)
            normed, exact_normed = torch.ops.tollway_cpu.rms_norm_pair(hidden, self.norm.weight, self.norm.eps)
        else:
            unit = self.norm.unit(hidden)  # shared by the head's input and the exact rows below
            normed, exact_normed = self.norm.weigh(unit), None
        logits = self.lm_head(normed)
        if self.dtype == torch.float32 and not head_approximates(self.lm_head, normed.shape[0]):
            return logits.float()
        if exact_normed is None:
            exact_normed = unit * self.norm.weight.float()
        return refine_top(logits, self.lm_head.weight, exact_normed)  # workers/models/logits_refine.py

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in a Hugging Face checkpoint, fusing q/k/v and gate/up.

        Raises ValueError naming missing or unexpected tensors.
        """
        remaining = dict(weights)

        def take(name: str) -> torch.Tensor:
            if name not in remaining:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return remaining.pop(name)

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            lm_head = remaining.pop("lm_head.weight", None)
            if not self.config.tie_word_embeddings:
                if lm_head is None:
                    raise ValueError("checkpoint is missing tensor 'lm_head.weight' (embeddings are not tied)")
                self.lm_head.weight.copy_(lm_head)
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, DecoderLayer)  # a ModuleList yields plain Modules to the type checker
                p = f"model.layers.{i}."
                for name, parts in FUSED_PROJECTIONS.items():
                    if self.config.num_experts and name in ("gate_up_proj", "down_proj"):
                        continue  # MoE classes load their experts before calling this
                    getattr(layer, name).weight.copy_(torch.cat([take(f"{p}{part}.weight") for part in parts]))
                if self.config.qkv_bias:
                    layer.qkv_proj.bias.copy_(torch.cat([take(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]))
                layer.input_norm.weight.copy_(take(f"{p}input_layernorm.weight"))
                layer.post_attention_norm.weight.copy_(take(f"{p}post_attention_layernorm.weight"))
        unexpected = [n for n in remaining if not n.endswith("rotary_emb.inv_freq")]
        if unexpected:
            raise ValueError(f"checkpoint has unexpected tensors, e.g. {unexpected[:3]}")
