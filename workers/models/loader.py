"""Loading a model folder (config.json + safetensors + tokenizer) into our implementation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from workers.models.assets import ModelFolderError, check_model_folder, source_gguf
from workers.models.config import ModelConfig, ModelConfigError
from workers.models.llama import LlamaForCausalLM
from workers.models.quantize import check_quantization, quantize_model
from workers.models.registry import model_class
from workers.models.tokenizer import TokenCodec


@dataclass
class LoadedModel:
    folder: Path
    model: LlamaForCausalLM
    tokenizer: TokenCodec
    eos_token_ids: tuple[int, ...]
    quantization: str = "none"
    """none, int8 or int4: how the decoder projections are stored (workers/models/quantize.py)."""
    activations: str = "int8"
    """What the quantized projections' decode steps take x as on a CPU: int8 or float (kernels/quantized/cpu.py)."""


def read_model_config(folder: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    except (OSError, json.JSONDecodeError, ModelConfigError) as exc:
        raise ModelFolderError(f"{folder}/config.json: {exc}") from exc


def build_model(config: ModelConfig, dtype: torch.dtype, device: str = "cpu") -> LlamaForCausalLM:
    """An uninitialised model of `config` (weights allocated on `device`, not filled) in `dtype`."""
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, by Hugging Face name, as stored."""
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


def load_weights(folder: Path, config: ModelConfig, dtype: torch.dtype, device: str = "cpu",
                 weights: dict[str, torch.Tensor] | None = None) -> LlamaForCausalLM:
    """The model of `config` filled from `weights` (read from `folder` when not given)."""
    model = build_model(config, dtype, device)
    try:
        model.load_hf_state_dict(read_weights(folder) if weights is None else weights)
    except (ValueError, RuntimeError) as exc:
        raise ModelFolderError(f"{folder}: weights do not match config.json: {exc}") from exc
    return model


def eos_token_ids(folder: Path, config: ModelConfig) -> tuple[int, ...]:
    ids = list(config.eos_token_ids)
    generation = folder / "generation_config.json"
    if generation.exists():
        value = json.loads(generation.read_text()).get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if value is not None else []
    return tuple(dict.fromkeys(int(i) for i in ids))


def load_model(folder: Path, dtype: torch.dtype, device: str = "cpu", quantization: str = "none",
               activations: str = "int8") -> LoadedModel:
    """Load weights (onto `device`), tokenizer and stop ids from a checked model folder; with
    `quantization` int8 or int4 the decoder projections are stored so (QuantizationError, a
    ValueError, for an unknown name or a model whose shapes do not allow it), their decode steps
    taking x as `activations` says (int8 or float: kernels/quantized/cpu.py `pack_for_cpu`)."""
    bits = check_quantization(quantization)
    check_model_folder(folder)
    config = read_model_config(folder)
    weights = read_weights(folder)
    model = load_weights(folder, config, dtype, device, weights)
    if bits:
        quantize_model(model, weights, quantization, source_gguf(folder), activations)
    return LoadedModel(
        folder=folder,
        model=model,
        tokenizer=TokenCodec.from_folder(folder),
        eos_token_ids=eos_token_ids(folder, config),
        quantization=quantization,
        activations=activations,
    )
