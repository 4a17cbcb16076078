"""The `tollway` command line.

Commands of the public contract that are not built yet say so on stderr and exit with status 2;
they never print made-up output.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import click
from rich.console import Console

NOT_BUILT_EXIT_CODE = 2
stderr = Console(stderr=True)


def not_built(command: str) -> NoReturn:
    stderr.print(f"[yellow]`tollway {command}` is not built yet[/] (see the Status section of README.md).")
    sys.exit(NOT_BUILT_EXIT_CODE)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """tollway: a self-hosted multi-tenant LLM serving platform."""


@cli.command()
@click.option("--port", type=int, default=8000, show_default=True, help="Gateway port on 127.0.0.1.")
def up(port: int) -> None:
    """Start gateway + engine worker + Celery worker on embedded defaults. (not built yet)"""
    not_built("up")


@cli.command()
@click.option("--model", default=None, help="Built-in name or local folder [default: TOLLWAY_MODEL].")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message in the model's chat template.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="0 is greedy.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (temperature > 0).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default=None,
              help="auto = bf16 where the CPU/GPU computes it natively [default: TOLLWAY_DTYPE].")
@click.argument("prompt")
def generate(
    model: str | None, chat: bool, max_tokens: int, temperature: float, seed: int | None,
    dtype: str | None, prompt: str,
) -> None:
    """Generate a completion offline (no server) and print it."""
    from ops.offline import run_generate
    from workers.settings import WorkerSettings

    settings = WorkerSettings()
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
              help="auto = bf16 where the CPU/GPU computes it natively [default: TOLLWAY_DTYPE].")
def worker(model: str | None, host: str, port: int, dtype: str | None) -> None:
    """Run one engine worker: the internal generate/info API the gateway routes to."""
    from ops.worker import run_worker
    from workers.settings import WorkerSettings

    settings = WorkerSettings()
    run_worker(settings, model=model or settings.model, dtype=dtype or settings.dtype, host=host, port=port,
               console=stderr)


@cli.group()
def tenants() -> None:
    """Manage tenants. (not built yet)"""


@tenants.command("create")
@click.argument("name")
@click.option("--rpm", type=int, help="Requests per minute.")
@click.option("--tpm", type=int, help="Tokens per minute.")
@click.option("--max-concurrent", type=int, help="Concurrent requests.")
@click.option("--monthly-token-budget", type=int, help="Tokens per calendar month.")
def tenants_create(name: str, **_: object) -> None:
    """Create a tenant with optional quotas. (not built yet)"""
    not_built("tenants create")


@cli.group()
def keys() -> None:
    """Manage API keys. (not built yet)"""


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant name.")
def keys_create(tenant: str) -> None:
    """Create an API key; it is printed once, only its hash is stored. (not built yet)"""
    not_built("keys create")


@cli.group()
def usage() -> None:
    """Usage and billing. (not built yet)"""


@usage.command("report")
@click.option("--tenant", help="Only this tenant.")
@click.option("--month", required=True, help="YYYY-MM")
@click.option("--format", "fmt", type=click.Choice(["csv", "json", "html"]), default="csv")
@click.option("--out", type=click.Path(dir_okay=False), help="Write to FILE instead of stdout.")
def usage_report(**_: object) -> None:
    """Billing report for a month. (not built yet)"""
    not_built("usage report")


@cli.group()
def batch() -> None:
    """Asynchronous batch jobs. (not built yet)"""


@batch.command("submit")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--api-key", required=True)
@click.option("--wait", is_flag=True, help="Wait with a progress bar until the batch ends.")
def batch_submit(**_: object) -> None:
    """Submit a JSONL batch. (not built yet)"""
    not_built("batch submit")


def main() -> None:
    cli()
