"""`tollway generate`: load a model and generate one completion in-process."""

from __future__ import annotations

import os

import click
import torch
from rich.console import Console

from workers.generate import SamplingParams, generate
from workers.models.assets import ModelFolderError, ModelNotFoundError, resolve_model_folder
from workers.models.loader import load_model
from workers.models.tokenizer import ChatTemplateError
from workers.precision import resolve_dtype
from workers.settings import WorkerSettings


def set_threads(num_threads: int) -> None:
    torch.set_num_threads(num_threads or os.cpu_count() or 1)


def run_generate(
    settings: WorkerSettings,
    *,
    model: str,
    prompt: str,
    chat: bool,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    dtype: str,
    console: Console,
) -> str:
    """The completion text (special tokens skipped, surrounding whitespace stripped)."""
    set_threads(settings.num_threads)
    try:
        with console.status(f"Loading {model}…"):
            folder = resolve_model_folder(
                model,
                settings.home,
                on_convert=lambda name: console.print(
                    f"Converting {name} once into {settings.home / 'models'} (about 20 s)…"
                ),
            )
            loaded = load_model(folder, resolve_dtype(dtype))
        tokenizer = loaded.tokenizer
        if chat:
            prompt_ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        else:
            prompt_ids = tokenizer.encode(prompt)
        max_len = loaded.model.config.max_position_embeddings
        if len(prompt_ids) + max_tokens > max_len:
            raise click.UsageError(
                f"prompt ({len(prompt_ids)} tokens) + --max-tokens ({max_tokens}) exceeds the "
                f"model's context of {max_len} tokens"
            )
        params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=seed)
        [completion] = generate(loaded.model, [prompt_ids], params, loaded.eos_token_ids)
    except (ModelNotFoundError, ModelFolderError, ChatTemplateError) as exc:
        raise click.ClickException(str(exc)) from exc
    return tokenizer.decode(completion, skip_special_tokens=True).strip()
