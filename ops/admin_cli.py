"""`tollway tenants ...` and `tollway keys ...`: tenant and API key administration.

Each command opens the accounting database of `AccountingSettings` (TOLLWAY_DATABASE_URL, or SQLite
in TOLLWAY_HOME), migrates it to the latest schema (idempotent, so a fresh home works) and runs in
one transaction. Bad input to the services exits 1 with a message on stderr; bad usage exits 2.
Plaintext keys are printed once on stdout and never stored or logged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

ERROR_EXIT_CODE = 1
QUOTA_OPTIONS = ("rpm", "tpm", "max-concurrent", "monthly-token-budget")


def _stderr() -> Console:
    return Console(stderr=True)


@contextmanager
def _session(invalidates: bool = False) -> Iterator[Session]:
    """A transaction on the migrated accounting database; AccountingError → message and exit 1.

    `invalidates`: the change can refuse keys that gateways hold in their caches, so after the
    commit every gateway replica is told to drop them (via Redis when TOLLWAY_REDIS_URL is set;
    otherwise their cache TTL bounds the delay).
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    from accounting.db import create_db_engine, session_factory, upgrade_database
    from accounting.settings import AccountingSettings
    from accounting.tenants import AccountingError

    url = AccountingSettings().url
    engine = create_db_engine(url)
    try:
        upgrade_database(engine)
        with session_factory(engine).begin() as session:
            yield session
        if invalidates:
            from gateway.settings import GatewaySettings
            from workers.wire.key_events import publish_invalidation

            publish_invalidation(GatewaySettings().redis_url)
    except AccountingError as error:
        _stderr().print(f"[red]error:[/] {escape(str(error))}")
        sys.exit(ERROR_EXIT_CODE)
    except OperationalError as error:
        where = make_url(url).render_as_string(hide_password=True)
        _stderr().print(f"[red]error:[/] cannot use the database {escape(where)}: {escape(str(error.orig))}")
        sys.exit(ERROR_EXIT_CODE)
    finally:
        engine.dispose()


def _quota_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(QUOTA_OPTIONS):
        help_text = {"rpm": "Requests per minute.", "tpm": "Tokens per minute.",
                     "max-concurrent": "Concurrent requests.",
                     "monthly-token-budget": "Tokens per calendar month."}[option]
        command = click.option(f"--{option}", type=click.IntRange(min=0), default=None,
                               help=f"{help_text} [default: unlimited]")(command)
    return command


def _weight_option(default: float | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option("--weight", type=click.FloatRange(min=0, min_open=True), default=default,
                        help="Scheduling weight: the tenant's share of an engine's service when tenants contend "
                             "(2 gets twice what 1 gets)." + (" [default: 1]" if default else ""))


def _time(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M")


def _limit(value: int | None) -> str:
    return "unlimited" if value is None else f"{value:,}"


@click.group()
def tenants() -> None:
    """Manage tenants and their quotas."""


@tenants.command("create")
@click.argument("name")
@_quota_options
@_weight_option(1.0)
def tenants_create(name: str, rpm: int | None, tpm: int | None, max_concurrent: int | None,
                   monthly_token_budget: int | None, weight: float) -> None:
    """Create a tenant with optional quotas (unlimited when left out) and scheduling weight."""
    from accounting.tenants import create_tenant

    with _session() as session:
        tenant = create_tenant(session, name, rpm=rpm, tpm=tpm, max_concurrent=max_concurrent,
                               monthly_token_budget=monthly_token_budget, weight=weight)
        click.echo(f"Created tenant {tenant.name} (id {tenant.id}, weight {tenant.weight:g}).")


@tenants.command("list")
def tenants_list() -> None:
    """List tenants and their quotas."""
    from accounting.tenants import list_tenants

    with _session() as session:
        rows = list_tenants(session)
    table = Table("id", "name", "status", "rpm", "tpm", "max concurrent", "monthly tokens", "weight", "created",
                  caption="times in UTC")
    for t in rows:
        table.add_row(str(t.id), escape(t.name), "disabled" if t.disabled else "enabled", _limit(t.rpm),
                      _limit(t.tpm), _limit(t.max_concurrent), _limit(t.monthly_token_budget), f"{t.weight:g}",
                      _time(t.created_at))
    Console().print(table)


@tenants.command("update")
@click.argument("name")
@_quota_options
@click.option("--unlimited", "unlimited", multiple=True, type=click.Choice(QUOTA_OPTIONS),
              help="Remove this limit (repeatable).")
@_weight_option(None)
def tenants_update(name: str, unlimited: tuple[str, ...], weight: float | None, **quotas: int | None) -> None:
    """Change some quotas or the scheduling weight of a tenant; the others stay as they are."""
    from accounting.tenants import UNLIMITED, update_tenant

    changes: dict[str, Any] = {field: value for field, value in quotas.items() if value is not None}
    if weight is not None:
        changes["weight"] = weight
    for option in unlimited:
        field = option.replace("-", "_")
        if field in changes:
            raise click.UsageError(f"--{option} and --unlimited {option} contradict each other")
        changes[field] = UNLIMITED
    if not changes:
        raise click.UsageError("nothing to update: give a quota option, --weight or --unlimited FIELD")
    with _session(invalidates=True) as session:
        tenant = update_tenant(session, name, **changes)
        click.echo(f"Updated tenant {tenant.name}: rpm {_limit(tenant.rpm)}, tpm {_limit(tenant.tpm)}, "
                   f"max concurrent {_limit(tenant.max_concurrent)}, "
                   f"monthly tokens {_limit(tenant.monthly_token_budget)}, weight {tenant.weight:g}.")


@tenants.command("disable")
@click.argument("name")
def tenants_disable(name: str) -> None:
    """Disable a tenant: its keys stop working until it is enabled again."""
    from accounting.tenants import set_tenant_disabled

    with _session(invalidates=True) as session:
        set_tenant_disabled(session, name, True)
        click.echo(f"Disabled tenant {name}.")


@tenants.command("enable")
@click.argument("name")
def tenants_enable(name: str) -> None:
    """Enable a disabled tenant."""
    from accounting.tenants import set_tenant_disabled

    with _session(invalidates=True) as session:
        set_tenant_disabled(session, name, False)
        click.echo(f"Enabled tenant {name}.")


@click.group()
def keys() -> None:
    """Manage API keys (only their hashes are stored)."""


def _print_once_note(key_id: int, prefix: str, tenant: str) -> None:
    _stderr().print(f"Key {key_id} ({escape(prefix)}…) of tenant {escape(tenant)}: store it now, "
                    "[bold]it will not be shown again[/].")


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant name.")
@click.option("--name", default=None, help="A label for the key.")
@click.option("--expires-in-days", type=click.IntRange(min=1), default=None,
              help="Expire the key after N days. [default: never]")
@click.option("--rpm", type=click.IntRange(min=0), default=None,
              help="This key's own requests per minute, counted on the key within the tenant's. [default: none]")
@click.option("--tpm", type=click.IntRange(min=0), default=None,
              help="This key's own tokens per minute, counted on the key within the tenant's. [default: none]")
def keys_create(tenant: str, name: str | None, expires_in_days: int | None, rpm: int | None,
                tpm: int | None) -> None:
    """Create an API key; it is printed once on stdout, only its hash is stored."""
    from accounting.api_keys import create_key
    from accounting.models import utcnow

    expires_at = None if expires_in_days is None else utcnow() + timedelta(days=expires_in_days)
    with _session() as session:
        key, plaintext = create_key(session, tenant, name=name, expires_at=expires_at, rpm=rpm, tpm=tpm)
        key_id, prefix = key.id, key.prefix
    # Only after the commit: a key is never shown unless it was stored.
    click.echo(plaintext)
    _print_once_note(key_id, prefix, tenant)


@keys.command("list")
@click.option("--tenant", default=None, help="Only this tenant's keys.")
def keys_list(tenant: str | None) -> None:
    """List API keys (display prefixes only)."""
    from accounting.api_keys import list_keys

    with _session() as session:
        rows = list_keys(session, tenant)
    table = Table("id", "tenant", "prefix", "name", "created", "expires", "revoked", caption="times in UTC")
    table.columns[2].no_wrap = True
    for k in rows:
        table.add_row(str(k.id), escape(k.tenant.name), escape(k.prefix), escape(k.name or "-"),
                      _time(k.created_at), _time(k.expires_at), _time(k.revoked_at))
    Console().print(table)


@keys.command("revoke")
@click.argument("key_id", type=int)
def keys_revoke(key_id: int) -> None:
    """Revoke an API key at once."""
    from accounting.api_keys import revoke_key

    with _session(invalidates=True) as session:
        key = revoke_key(session, key_id)
        click.echo(f"Revoked key {key.id} ({key.prefix}…) of tenant {key.tenant.name}.")


@keys.command("rotate")
@click.argument("key_id", type=int)
@click.option("--grace-seconds", type=click.IntRange(min=0), default=3600, show_default=True,
              help="How long the old key keeps working.")
def keys_rotate(key_id: int, grace_seconds: int) -> None:
    """Replace an API key: prints the new key; the old one expires after the grace period."""
    from accounting.api_keys import rotate_key

    with _session(invalidates=True) as session:
        key, plaintext = rotate_key(session, key_id, grace_seconds)
        key_id_new, prefix, tenant = key.id, key.prefix, key.tenant.name
    click.echo(plaintext)
    _print_once_note(key_id_new, prefix, tenant)
    _stderr().print(f"The old key {key_id} stops working within {grace_seconds} s.")
