"""A tiny random-weight model of the same architecture, for fast tests (seeded, no downloads).

`write_tiny_model_folder` writes a complete Hugging Face folder: config.json, safetensors weights
under Hugging Face names, and a word-level tokenizer with a ChatML-style chat template, so the
loader, tokenizer, CLI and transformers itself can all read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = [f"w{i}" for i in range(125)] + ["user", "assistant", "system"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' + message['content'] "
    "+ '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


def tiny_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """A Hugging Face config dict: 2 layers, 4 query / 2 KV heads of dim 16, vocab 128 + specials."""
    config: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "mistral": "MistralForCausalLM"}[model_type]],
        "model_type": model_type,
        "vocab_size": len(SPECIAL_TOKENS) + len(WORDS),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def tiny_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names, scaled so activations stay well conditioned."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    qkv_bias = config.get("attention_bias", config["model_type"] == "qwen2")

    def rand(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            weights[f"{p}self_attn.{name}_proj.weight"] = rand(rows, hidden)
            if qkv_bias:
                weights[f"{p}self_attn.{name}_proj.bias"] = rand(rows)
        weights[f"{p}self_attn.o_proj.weight"] = rand(hidden, q_size)
        weights[f"{p}mlp.gate_proj.weight"] = rand(inter, hidden)
        weights[f"{p}mlp.up_proj.weight"] = rand(inter, hidden)
        weights[f"{p}mlp.down_proj.weight"] = rand(hidden, inter)
        weights[f"{p}input_layernorm.weight"] = 1.0 + rand(hidden, std=0.1)
        weights[f"{p}post_attention_layernorm.weight"] = 1.0 + rand(hidden, std=0.1)
    weights["model.norm.weight"] = 1.0 + rand(hidden, std=0.1)
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = rand(config["vocab_size"], hidden, std=0.3)
    return weights


def tiny_tokenizer() -> Tokenizer:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def write_tiny_model_folder(folder: Path, model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(model_type, **overrides)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tiny_weights(config, seed), str(folder / "model.safetensors"))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
    }, indent=2))
    return folder
