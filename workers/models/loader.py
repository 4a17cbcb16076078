"""Loading a model folder (config.json + safetensors + tokenizer) into our implementation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from workers.models.assets import ModelFolderError, check_model_folder
from workers.models.config import ModelConfig, ModelConfigError
from workers.models.llama import LlamaForCausalLM
from workers.models.registry import model_class
from workers.models.tokenizer import TokenCodec


@dataclass
class LoadedModel:
    folder: Path
    model: LlamaForCausalLM
    tokenizer: TokenCodec
    eos_token_ids: tuple[int, ...]


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


def load_weights(folder: Path, config: ModelConfig, dtype: torch.dtype, device: str = "cpu") -> LlamaForCausalLM:
    files = sorted(folder.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(str(path)))
    model = build_model(config, dtype, device)
    try:
        model.load_hf_state_dict(weights)
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


def load_model(folder: Path, dtype: torch.dtype, device: str = "cpu") -> LoadedModel:
    """Load weights (onto `device`), tokenizer and stop ids from a checked model folder."""
    check_model_folder(folder)
    config = read_model_config(folder)
    return LoadedModel(
        folder=folder,
        model=load_weights(folder, config, dtype, device),
        tokenizer=TokenCodec.from_folder(folder),
        eos_token_ids=eos_token_ids(folder, config),
    )
