"""Architecture description of a Llama-family model, parsed from a Hugging Face `config.json`.

Llama, Mistral and Qwen2 share one architecture (RMSNorm, RoPE, GQA, SwiGLU); they differ only in
a few switches captured here: bias on the q/k/v projections (Qwen2), a sliding window (Mistral),
and the RoPE frequency scaling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_q_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

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
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        try:
            num_q_heads = int(hf["num_attention_heads"])
            hidden_size = int(hf["hidden_size"])
            head_dim = int(hf.get("head_dim") or hidden_size // num_q_heads)
            window = hf.get("sliding_window")
            use_window = window is not None and hf.get("use_sliding_window", model_type != "qwen2")
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
            )
        except (KeyError, TypeError) as exc:
            raise ModelConfigError(f"config.json is missing or has a malformed field: {exc}") from exc


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
