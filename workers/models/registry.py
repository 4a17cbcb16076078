"""model_type (config.json) -> our implementation class. Parsing (config.py) refuses the types
and features none of these implement, so every parsed config has an entry here."""

from __future__ import annotations

from workers.models.config import ModelConfig, ModelConfigError
from workers.models.gemma import GemmaForCausalLM
from workers.models.llama import LlamaForCausalLM
from workers.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from workers.models.phi3 import Phi3ForCausalLM
from workers.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise ModelConfigError(f"model_type {config.model_type!r} has no implementation") from None
