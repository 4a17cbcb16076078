"""Architecture description of a Llama-family model, parsed from a Hugging Face `config.json`.

Llama, Mistral and Qwen2 share one architecture (RMSNorm, RoPE, GQA, SwiGLU); they differ only in
a few switches captured here: bias on the q/k/v projections (Qwen2), a sliding window (Mistral),
and the RoPE frequency scaling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text")
REFUSED_MODEL_TYPES = {
    "gemma3": "only the text model is supported: use a gemma3_text checkpoint",
}


class ModelConfigError(ValueError):
    """A config.json that does not describe a model we can run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    # "default", "linear" or "llama3"; the keys below are read only for the matching type.
    scaling_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    rope: RopeConfig
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    # Family switches (workers/models/registry.py picks the class by model_type):
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before RoPE
    num_experts: int = 0  # MoE (Mixtral, Qwen3-MoE): experts per layer; 0 = dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1 (Mixtral always does)
    # Gemma 3: per-layer "sliding_attention" / "full_attention" (empty: every layer alike), the
    # sliding layers' RoPE, the attention scale's denominator, and tanh capping of the final logits.
    layer_types: tuple[str, ...] = ()
    local_rope: RopeConfig | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2 (attends on the torch reference: see dispatch)

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_q_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: the layer sees the whole context). Layers with different
        windows get one block table per group (cache/kv_layout.py)."""
        if not self.layer_types:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict; raises ModelConfigError naming what is wrong."""
        model_type = hf.get("model_type")
        if model_type in REFUSED_MODEL_TYPES:
            raise ModelConfigError(f"model_type {model_type!r} is not supported yet: {REFUSED_MODEL_TYPES[model_type]}")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        try:
            num_q_heads = int(hf["num_attention_heads"])
            hidden_size = int(hf["hidden_size"])
            head_dim = int(hf.get("head_dim") or hidden_size // num_q_heads)
            window = hf.get("sliding_window")
            use_window = window is not None and hf.get("use_sliding_window", model_type not in ("qwen2", "qwen3"))
            _check_unsupported(hf, model_type)
            num_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
            return cls(
                model_type=model_type,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_q_heads=num_q_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_q_heads),
                head_dim=head_dim,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
                sliding_window=int(window) if use_window and window is not None else None,
                rope=_parse_rope(hf),
                eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
                bos_token_id=hf.get("bos_token_id"),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                num_experts=num_experts if model_type in ("mixtral", "qwen3_moe") else 0,
                num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if model_type == "qwen3_moe" else True,
                **(_gemma_fields(hf, model_type) if model_type in ("gemma2", "gemma3_text") else {}),
            )
        except (KeyError, TypeError) as exc:
            raise ModelConfigError(f"config.json is missing or has a malformed field: {exc}") from exc


def _check_unsupported(hf: dict[str, Any], model_type: str) -> None:
    """Refuse switches our layers do not implement, naming them."""
    rotary = hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if rotary is not None and float(rotary) != 1.0:
        raise ModelConfigError(f"partial_rotary_factor {rotary} is not supported (only full rotary embeddings)")
    if model_type == "qwen3_moe":
        sparse_step = int(hf.get("decoder_sparse_step", 1))
        if sparse_step != 1 or hf.get("mlp_only_layers"):
            raise ModelConfigError("qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported")
    if model_type in ("gemma2", "gemma3_text"):
        if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ModelConfigError(f"hidden_activation {hf['hidden_activation']!r} is not supported (gelu_pytorch_tanh)")
        if hf.get("use_bidirectional_attention"):
            raise ModelConfigError("use_bidirectional_attention is not supported (causal decoders only)")
    elif hf.get("layer_types") and len(set(hf["layer_types"])) > 1:
        raise ModelConfigError(f"mixed layer_types {sorted(set(hf['layer_types']))} are not supported")
    if model_type == "phi3" and hf.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")


def _gemma_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Gemma 2 / 3 text: per-layer types and RoPE (Gemma 3: nested `rope_parameters`, or the older
    `rope_theta` / `rope_scaling` for global layers and `rope_local_base_freq` for sliding ones;
    Gemma 2: one RoPE for all layers). Older configs without `layer_types` alternate (Gemma 2)
    or put one global layer after every five sliding ones (Gemma 3)."""
    num_layers = int(hf["num_hidden_layers"])
    default_pattern = 2 if model_type == "gemma2" else 6
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or default_pattern)
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
    ]
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown or len(types) != num_layers:
        raise ModelConfigError(f"layer_types {sorted(set(types))} ({len(types)} for {num_layers} layers) not supported")
    params = hf.get("rope_parameters") or {}
    local = params.get("sliding_attention") or {"rope_type": "default",
                                                 "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    softcap = hf.get("final_logit_softcapping")
    attn_softcap = hf.get("attn_logit_softcapping")
    return {
        "layer_types": tuple(types),
        "local_rope": _parse_rope(hf if model_type == "gemma2" else {"rope_parameters": local}),
        "attn_logit_softcapping": float(attn_softcap) if attn_softcap is not None else None,
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or int(hf["hidden_size"]) // int(hf["num_attention_heads"])),
        "final_logit_softcapping": float(softcap) if softcap is not None else None,
    }


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


def _parse_rope(hf: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs use `rope_theta` and
    # an optional `rope_scaling` dict.
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params:  # per layer type (Gemma 3): this is the global layers' RoPE
        params = dict(params["full_attention"])
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling_type = params.get("rope_type") or params.get("type") or "default"
    if scaling_type not in ("default", "linear", "llama3"):
        raise ModelConfigError(f"rope scaling {scaling_type!r} is not supported (default, linear, llama3)")
    return RopeConfig(
        theta=theta,
        scaling_type=scaling_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
