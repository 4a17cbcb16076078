"""The `tollway` command line.

Commands of the public contract that are not built yet say so on stderr and exit with status 2;
they never print made-up output.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click
from rich.console import Console

from ops.admin_cli import keys, tenants
from ops.batch_cli import batch
from ops.billing_cli import prices, usage
from ops.eval_cli import eval_ppl

if TYPE_CHECKING:
    from workers.settings import WorkerSettings

stderr = Console(stderr=True)
TENSOR_PARALLEL_HELP = ("Split the model across N processes (gloo on CPU, NCCL on CUDA; Llama/Mistral/Qwen2, "
                        "heads divisible by N) [default: TOLLWAY_TENSOR_PARALLEL_SIZE or 1].")
QUANTIZATION_HELP = ("Weight-only quantization of the linear layers: int8 (per channel), int4 (groups of 32; a GGUF's "
                     "own Q4 blocks where the model came from one) [default: TOLLWAY_QUANTIZATION or none].")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """tollway: a self-hosted multi-tenant LLM serving platform."""


def worker_settings() -> WorkerSettings:
    """The engine side's settings from the environment; a bad TOLLWAY_* value is a usage error
    (exit 2, the variable named) rather than a traceback."""
    from pydantic import ValidationError

    from workers.settings import WorkerSettings

    try:
        return WorkerSettings()
    except ValidationError as exc:
        problems = "; ".join(f"TOLLWAY_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors())
        raise click.UsageError(problems) from exc


def with_overrides(settings: WorkerSettings, quantization: str | None, tensor_parallel_size: int | None,
                   dtype: str | None = None) -> WorkerSettings:
    """The settings with the command line's --quantization / --tensor-parallel-size / --dtype where given
    (one dtype for the model and for the settings' checks, `engine_config`)."""
    update: dict[str, object] = {}
    if dtype is not None:
        update["dtype"] = dtype
    if quantization is not None:
        update["quantization"] = quantization
    if tensor_parallel_size is not None:
        update["tensor_parallel_size"] = tensor_parallel_size
    return settings.model_copy(update=update) if update else settings


@cli.command()
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
              help="Gateway port on 127.0.0.1.")
@click.option("--workers", "num_workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Engine workers, per model with --model (all share the CPU cores equally).")
@click.option("--worker-port", type=click.IntRange(1, 65535), default=8100, show_default=True,
              help="Port of the first engine worker; the others follow.")
@click.option("--quantization", type=click.Choice(["none", "int8", "int4"]), default=None,
              help="The engine workers' weight quantization (passed as TOLLWAY_QUANTIZATION) "
                   "[default: TOLLWAY_QUANTIZATION or none].")
@click.option("--model", "model_specs", multiple=True, metavar="[NAME=]MODEL",
              help="A model to serve (repeatable: one gateway in front of all): a built-in name, a folder "
                   "under $TOLLWAY_HOME/models/ or a path, served as NAME when given, else as its name or "
                   "folder name. --workers workers each. [default: TOLLWAY_MODEL]")
def up(port: int, num_workers: int, worker_port: int, quantization: str | None, model_specs: tuple[str, ...]) -> None:
    """Start the gateway and the engine workers on embedded defaults, and keep them running."""
    from gateway.settings import GatewaySettings
    from ops.served_models import ModelSpecError, check_model_sources, parse_model_specs
    from ops.supervisor import run_up
    from workers.models.assets import ModelFolderError, ModelNotFoundError

    try:
        models = parse_model_specs(model_specs)
    except ModelSpecError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from exc
    try:
        check_model_sources(models, GatewaySettings().home.resolve())
    except (ModelNotFoundError, ModelFolderError) as exc:
        raise click.ClickException(str(exc)) from exc
    sys.exit(run_up(port, num_workers, worker_port, stderr, quantization=quantization, models=models))


@cli.command()
@click.option("--host", default=None, help="[default: TOLLWAY_HOST or 127.0.0.1]")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="[default: TOLLWAY_PORT or 8000]")
def gateway(host: str | None, port: int | None) -> None:
    """Run one gateway process (workers from TOLLWAY_WORKER_URLS); `tollway up` runs this for you."""
    import logging

    from gateway.app import run_gateway
    from gateway.settings import GatewaySettings
    from ops.startup_heap import frozen_startup_heap, rarer_young_collections

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = GatewaySettings()
    settings = settings.model_copy(update={"host": host or settings.host, "port": port or settings.port})
    run_gateway(settings, last_contexts=[frozen_startup_heap, rarer_young_collections])


@cli.command()
@click.option("--model", default=None, help="Built-in name or local folder [default: TOLLWAY_MODEL].")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message in the model's chat template.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="0 is greedy.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (temperature > 0).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default=None,
              help="auto = bf16 on a GPU, or a CPU where it measures faster than fp32 [default: TOLLWAY_DTYPE].")
@click.option("--quantization", type=click.Choice(["none", "int8", "int4"]), default=None, help=QUANTIZATION_HELP)
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=None, help=TENSOR_PARALLEL_HELP)
@click.argument("prompt")
def generate(
    model: str | None, chat: bool, max_tokens: int, temperature: float, seed: int | None,
    dtype: str | None, quantization: str | None, tensor_parallel_size: int | None, prompt: str,
) -> None:
    """Generate a completion offline (no server) and print it."""
    from ops.offline import run_generate

    if not prompt and not chat:  # before the model loads: an empty text has no token to continue
        raise click.UsageError("PROMPT is empty: give a text to continue (or --chat to send it as a message)")

    settings = with_overrides(worker_settings(), quantization, tensor_parallel_size, dtype)
    text = run_generate(
        settings,
        model=model or settings.model,
        prompt=prompt,
        chat=chat,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        dtype=dtype or settings.dtype,
        console=stderr,
    )
    click.echo(text)


@cli.command()
@click.option("--model", default=None, help="Built-in name or local folder [default: TOLLWAY_MODEL].")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8100, show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default=None,
              help="auto = bf16 on a GPU, or a CPU where it measures faster than fp32 [default: TOLLWAY_DTYPE].")
@click.option("--quantization", type=click.Choice(["none", "int8", "int4"]), default=None, help=QUANTIZATION_HELP)
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=None, help=TENSOR_PARALLEL_HELP)
@click.option("--served-name", default=None,
              help="The model id this worker reports to gateways (what clients send as `model`) "
                   "[default: --model as given].")
def worker(model: str | None, host: str, port: int, dtype: str | None, quantization: str | None,
           tensor_parallel_size: int | None, served_name: str | None) -> None:
    """Run one engine worker: the internal generate/info API the gateway routes to."""
    from ops.served_models import MAX_NAME_LENGTH, is_valid_name
    from ops.worker import run_worker

    if served_name is not None and not is_valid_name(served_name):
        raise click.BadParameter(f"{served_name!r} cannot be a model id (letters, digits, '.', '_', '-', ':'; "
                                 f"at most {MAX_NAME_LENGTH} characters)", param_hint="--served-name")
    settings = with_overrides(worker_settings(), quantization, tensor_parallel_size, dtype)
    run_worker(settings, model=model or settings.model, dtype=dtype or settings.dtype, host=host, port=port,
               console=stderr, served_name=served_name)


cli.add_command(tenants)
cli.add_command(keys)


cli.add_command(usage)
cli.add_command(prices)


cli.add_command(batch)
cli.add_command(eval_ppl)


def main() -> None:
    cli()


if __name__ == "__main__":  # `python -m ops.cli`: how `tollway up` starts its children
    main()
