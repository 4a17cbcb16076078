"""`tollway eval-ppl`: the perplexity of a text file through the engine, in-process (no server).

The text is tokenized whole with the model's tokenizer (as the gateway tokenizes a prompt) and
scored in sliding windows (ops/perplexity.py: `--window` tokens, default the model's context;
`--stride`, default half the window). Progress is the windows' tokens computed so far.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

if TYPE_CHECKING:  # the engine (torch) loads when the command runs, not with the CLI
    from ops.perplexity import Perplexity

QUANTIZATIONS = ("none", "int8", "int4")


@click.command("eval-ppl")
@click.option("--model", default=None, help="Built-in name or local folder [default: TOLLWAY_MODEL].")
@click.option("--quantization", type=click.Choice(QUANTIZATIONS), default=None,
              help="Weight-only quantization of the linear layers [default: TOLLWAY_QUANTIZATION or none].")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default=None,
              help="auto = bf16 on a GPU, or a CPU where it measures faster than fp32 [default: TOLLWAY_DTYPE].")
@click.option("--window", type=click.IntRange(min=2), default=None,
              help="Tokens per window [default: the model's context].")
@click.option("--stride", type=click.IntRange(min=1), default=None,
              help="Tokens from one window's start to the next's [default: half the window].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def eval_ppl(model: str | None, quantization: str | None, dtype: str | None, window: int | None,
             stride: int | None, as_json: bool, file: Path) -> None:
    """Perplexity of a text FILE through the engine, in sliding windows (no server)."""
    from ops.cli import worker_settings
    from ops.offline import build_engine, engine_config, load_named_model
    from ops.perplexity import perplexity, plan_windows
    from workers.models.tokenizer import tokenizer_payload
    from workers.wire.tokenizer import TextTokenizer

    settings = worker_settings()
    if quantization is not None:
        settings = settings.model_copy(update={"quantization": quantization})
    wanted = settings.quantization
    stderr = Console(stderr=True)
    model = model or settings.model
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.UsageError(f"cannot read {file} as UTF-8 text: {exc}") from exc
    loaded = load_named_model(settings, model, dtype or settings.dtype, stderr)
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(loaded.folder))
    token_ids = tokenizer.encode(text)
    engine = build_engine(loaded, engine_config(settings, dtype or settings.dtype), model)
    window = window or engine.max_context
    if window > engine.max_context:
        raise click.UsageError(f"--window {window} exceeds the model's context of {engine.max_context} tokens")
    stride = stride or max(1, window // 2)
    try:
        plan = plan_windows(len(token_ids), window, stride)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    started = time.perf_counter()
    with Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                  TimeRemainingColumn(), console=stderr, transient=True) as progress:
        task = progress.add_task("scoring", total=sum(w.num_tokens for w in plan))
        try:
            result = perplexity(engine, token_ids, window, stride,
                                on_progress=lambda done: progress.update(task, completed=done))
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from exc
    elapsed = time.perf_counter() - started
    dtype_name = str(loaded.model.dtype).removeprefix("torch.")
    report(result, file, model, dtype_name, wanted, window, stride, elapsed, as_json)


def report(result: Perplexity, file: Path, model: str, dtype: str, quantization: str, window: int, stride: int,
           elapsed_s: float, as_json: bool) -> None:
    figures = {"file": str(file), "model": model, "dtype": dtype, "quantization": quantization,
               "window": window, "stride": stride, "windows": result.windows, "tokens": result.tokens,
               "mean_nll": result.mean_nll, "perplexity": result.perplexity, "seconds": round(elapsed_s, 2)}
    if as_json:
        click.echo(json.dumps(figures))
        return
    click.echo(f"file        {file}")
    click.echo(f"model       {model} ({dtype}, quantization {quantization})")
    click.echo(f"windows     {result.windows} (window {window}, stride {stride} tokens)")
    click.echo(f"tokens      {result.tokens} scored")
    click.echo(f"mean NLL    {result.mean_nll:.4f} nats/token")
    click.echo(f"perplexity  {result.perplexity:.4f}")
    click.echo(f"time        {elapsed_s:.1f} s ({result.tokens / elapsed_s:.0f} tokens/s)")
