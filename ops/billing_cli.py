"""`tollway usage report` and `tollway prices ...`: billing reports and model prices.

Same database handling as `ops.admin_cli` (its `_session`): TOLLWAY_DATABASE_URL or SQLite in
TOLLWAY_HOME, migrated first, one transaction per command; bad input exits 1 with a message on
stderr, bad usage exits 2. Prices are per 1M tokens, exact decimals; times are UTC.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ops.admin_cli import _session

FORMATS = ("csv", "json", "html")


@click.group()
def usage() -> None:
    """Usage and billing reports."""


@usage.command("report")
@click.option("--tenant", default=None, help="Only this tenant. [default: every tenant]")
@click.option("--month", required=True, metavar="YYYY-MM", help="The calendar month (UTC).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="csv", show_default=True)
@click.option("--daily", is_flag=True, help="CSV: one row per tenant, model and day (not per month).")
@click.option("--out", type=click.Path(dir_okay=False, writable=True, path_type=Path), default=None,
              help="Write to FILE instead of stdout.")
def usage_report(tenant: str | None, month: str, fmt: str, daily: bool, out: Path | None) -> None:
    """Usage and cost per tenant, model and day for a month, from the prices then in effect."""
    from accounting.report_render import to_csv, to_html, to_json
    from accounting.reports import usage_report as build_report

    if daily and fmt != "csv":
        raise click.UsageError("--daily applies to --format csv only (json and html have the days already)")
    with _session() as session:
        report = build_report(session, month, tenant)
    text = to_csv(report, daily=daily) if fmt == "csv" else to_json(report) if fmt == "json" else to_html(report)
    if out is None:
        click.echo(text, nl=False)
        return
    out.write_text(text, encoding="utf-8")
    Console(stderr=True).print(f"Wrote the {fmt} report of {escape(month)} to {escape(str(out))}.")
    if report.unpriced:
        Console(stderr=True).print("[yellow]warning:[/] some requests had no price in effect; their cost "
                                   "is left empty (see `tollway prices set`).")


@click.group()
def prices() -> None:
    """Model prices per 1M tokens (with history)."""


@prices.command("set")
@click.argument("model")
@click.option("--input", "input_", required=True, metavar="PRICE", help="Per 1M uncached prompt tokens.")
@click.option("--cached-input", required=True, metavar="PRICE", help="Per 1M cached prompt tokens.")
@click.option("--output", required=True, metavar="PRICE", help="Per 1M completion tokens.")
@click.option("--batch-discount", default="0", show_default=True, metavar="FRACTION",
              help="Fraction off batch requests (0.5 = half price).")
@click.option("--effective-from", default=None, metavar="YYYY-MM-DD",
              help="Start (UTC midnight, or an ISO datetime); the current price ends there. [default: now]")
def prices_set(model: str, input_: str, cached_input: str, output: str, batch_discount: str,
               effective_from: str | None) -> None:
    """Set a model's prices from a date on; the previous price ends where this one starts."""
    from accounting.prices import parse_when, set_price

    with _session() as session:
        start = parse_when(effective_from) if effective_from is not None else None
        price = set_price(session, model, input_per_mtok=input_, cached_input_per_mtok=cached_input,
                          output_per_mtok=output, batch_discount=batch_discount, effective_from=start)
        click.echo(f"Set the price of {price.model} from {price.effective_from:%Y-%m-%d %H:%M} UTC "
                   f"(id {price.id}).")


@prices.command("list")
@click.option("--model", default=None, help="Only this model's prices.")
def prices_list(model: str | None) -> None:
    """List prices per 1M tokens, with their periods."""
    from accounting.prices import decimal_text, list_prices

    with _session() as session:
        rows = list_prices(session, model)
    table = Table("id", "model", "input", "cached input", "output", "batch discount", "from", "to",
                  caption="per 1M tokens; times in UTC")
    for p in rows:
        table.add_row(str(p.id), escape(p.model), decimal_text(p.input_per_mtok),
                      decimal_text(p.cached_input_per_mtok), decimal_text(p.output_per_mtok),
                      decimal_text(p.batch_discount), f"{p.effective_from:%Y-%m-%d %H:%M}",
                      "-" if p.effective_to is None else f"{p.effective_to:%Y-%m-%d %H:%M}")
    Console().print(table)
