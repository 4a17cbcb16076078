"""`tollway generate`: load a model and generate one completion in-process."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import torch
from opentelemetry.trace import Tracer
from rich.console import Console

from workers.engine.config import EngineConfig
from workers.engine.draft_model import DraftModelError
from workers.engine.drafter import check_speculative
from workers.engine.engine import Engine
from workers.models.assets import ModelFolderError, ModelNotFoundError, resolve_model_folder
from workers.models.loader import LoadedModel, load_model
from workers.models.quantize import QuantizationError
from workers.models.tokenizer import tokenizer_payload
from workers.parallel.layers import TensorParallelError
from workers.precision import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from workers.settings import WorkerSettings
from workers.wire.sampling import SamplingParams
from workers.wire.tokenizer import ChatTemplateError, TextTokenizer


def set_threads(num_threads: int) -> None:
    torch.set_num_threads(num_threads or os.cpu_count() or 1)


def resolve_named(settings: WorkerSettings, model: str, say: Callable[[str], None]) -> Path:
    """The folder of `model` (a name or path), converting it once under the home first if needed,
    with a line to `say` before that (slow) conversion."""
    return resolve_model_folder(model, settings.home, on_convert=lambda name: say(
        f"Converting {name} once into {settings.home / 'models'} (about 20 s)…"))


def load_named_model(settings: WorkerSettings, model: str, dtype: str, console: Console) -> LoadedModel:
    """Resolve (converting once if needed) and load a model onto the settings' device, quantized as
    the settings say, with progress on the console."""
    set_threads(settings.num_threads)
    try:
        device = resolve_device(settings.device)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        quantized = "" if settings.quantization == "none" else f" ({settings.quantization})"
        with console.status(f"Loading {model}{quantized}…"):
            folder = resolve_named(settings, model, console.print)
            return load_model(folder, resolve_dtype(dtype, device), device, settings.quantization,
                              settings.quantized_activations)
    except (ModelNotFoundError, ModelFolderError, QuantizationError) as exc:
        raise click.ClickException(str(exc)) from exc


@contextmanager
def serving_model(settings: WorkerSettings, model: str, dtype: str, console: Console) -> Iterator[LoadedModel]:
    """The model to build the engine on, for the duration of the block: loaded in-process
    (`load_named_model`) with tensor parallel size 1; else this process's shard as rank 0 of
    `settings.tensor_parallel_size` ranks, the followers stopped when the block ends."""
    size = settings.tensor_parallel_size
    if size == 1:
        yield load_named_model(settings, model, dtype, console)
        return
    from workers.parallel.launch import start_tensor_parallel  # torch.distributed only when asked for

    try:
        device = resolve_device(settings.device)
        with console.status(f"Starting {size} tensor parallel ranks of {model}…"):
            folder = resolve_named(settings, model, console.print)
            run = start_tensor_parallel(folder, resolve_dtype(dtype, device), device, size, settings.attention,
                                        settings.num_threads, settings.quantization)
    except (ModelNotFoundError, ModelFolderError, TensorParallelError) as exc:
        raise click.ClickException(str(exc)) from exc
    with run:
        yield run.loaded


def engine_config(settings: WorkerSettings, dtype: str | None = None) -> EngineConfig:
    """The engine's configuration from the settings; a ClickException for a speculative mode or KV
    cache dtype this build cannot run (checked before any model loads). `dtype`: the model's dtype
    as the command was given it (`--dtype`), when not the settings' own."""
    try:
        check_speculative(settings.speculative, settings.draft_model)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    draft_model = None
    if settings.speculative == "draft" and settings.draft_model:
        try:  # its vocabulary is checked against the model's when the engine starts (`build_engine`)
            draft_model = str(resolve_named(settings, settings.draft_model, lambda line: click.echo(line, err=True)))
        except (ModelNotFoundError, ModelFolderError) as exc:
            raise click.ClickException(f"TOLLWAY_DRAFT_MODEL: {exc}") from exc
    if settings.speculative_tokens < 1:
        raise click.ClickException("TOLLWAY_SPECULATIVE_TOKENS must be at least 1")
    try:  # the engine checks again with the loaded model's own dtype and device
        device = resolve_device(settings.device)
        resolve_kv_cache_dtype(settings.kv_cache_dtype, resolve_dtype(dtype or settings.dtype, device),
                               device.split(":")[0])
    except ValueError as exc:
        raise click.ClickException(f"TOLLWAY_KV_CACHE_DTYPE: {exc}") from exc
    return EngineConfig(kv_budget_bytes=settings.kv_cache_mb * 2**20, kv_cache_dtype=settings.kv_cache_dtype,
                        max_batch_tokens=settings.max_batch_tokens,
                        attention=settings.attention, compile=settings.compile, cuda_graphs=settings.cuda_graphs,
                        overlap=settings.overlap,
                        scheduling=settings.scheduling,
                        max_running_per_tenant=settings.max_running_per_tenant,
                        speculative=settings.speculative, speculative_tokens=settings.speculative_tokens,
                        speculative_ngram=settings.speculative_ngram, draft_model=draft_model,
                        speculative_max_batch=settings.speculative_max_batch)


def build_engine(loaded: LoadedModel, config: EngineConfig, name: str, tracer: Tracer | None = None) -> Engine:
    """The engine on `loaded`; a ClickException for settings it refuses only with the model at hand
    (a draft model that does not share the model's tokenizer)."""
    try:
        return Engine(loaded, config, name=name, tracer=tracer)
    except DraftModelError as exc:
        raise click.ClickException(f"TOLLWAY_DRAFT_MODEL: {exc}") from exc


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
    with serving_model(settings, model, dtype, console) as loaded:
        tokenizer = TextTokenizer.from_payload(tokenizer_payload(loaded.folder))
        try:
            prompt_ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
                          else tokenizer.encode(prompt))
        except ChatTemplateError as exc:
            raise click.ClickException(str(exc)) from exc
        if not prompt_ids:
            raise click.UsageError("PROMPT has no tokens: give a text to continue")
        engine = build_engine(loaded, engine_config(settings, dtype), name=model)
        if len(prompt_ids) + max_tokens > engine.max_context:
            raise click.UsageError(
                f"prompt ({len(prompt_ids)} tokens) + --max-tokens ({max_tokens}) exceeds the "
                f"model's context of {engine.max_context} tokens"
            )
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        [seq] = engine.generate_batch([prompt_ids], params)
        return tokenizer.decode(seq.output_ids, skip_special_tokens=True).strip()
