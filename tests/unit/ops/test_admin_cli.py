"""`tollway tenants ...` and `tollway keys ...` against a SQLite database in a temporary home."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from accounting.api_keys import AuthRecord, authenticate
from accounting.db import create_db_engine, session_factory
from accounting.keys import hash_api_key, looks_like_api_key
from accounting.settings import AccountingSettings
from accounting.tenants import get_tenant
from ops.cli import cli


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path))
    monkeypatch.delenv("TOLLWAY_DATABASE_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "200")  # rich tables: no wrapping in assertions
    return tmp_path


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def auth(key: str) -> AuthRecord | None:
    engine = create_db_engine(AccountingSettings().url)
    try:
        with session_factory(engine)() as session:
            return authenticate(session, hash_api_key(key))
    finally:
        engine.dispose()


@pytest.fixture
def acme() -> Iterator[None]:
    result = run("tenants", "create", "acme", "--rpm", "60", "--tpm", "1000")
    assert result.exit_code == 0, result.output
    yield


def create_key(*extra: str) -> str:
    result = run("keys", "create", "--tenant", "acme", *extra)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and looks_like_api_key(lines[0])  # the key, alone
    assert "will not be shown again" in result.stderr
    return lines[0]


def test_tenants_create_list_update_disable(acme: None, home: Path) -> None:
    assert (home / "tollway.db").is_file()
    listing = run("tenants", "list")
    assert listing.exit_code == 0 and "acme" in listing.stdout and "1,000" in listing.stdout

    result = run("tenants", "update", "acme", "--max-concurrent", "3", "--unlimited", "rpm")
    assert result.exit_code == 0, result.output
    engine = create_db_engine(AccountingSettings().url)
    with session_factory(engine)() as session:
        tenant = get_tenant(session, "acme")
        assert (tenant.rpm, tenant.tpm, tenant.max_concurrent) == (None, 1000, 3)
    engine.dispose()

    assert run("tenants", "disable", "acme").exit_code == 0
    assert "disabled" in run("tenants", "list").stdout
    assert run("tenants", "enable", "acme").exit_code == 0
    assert "enabled" in run("tenants", "list").stdout


def test_tenant_errors(acme: None) -> None:
    duplicate = run("tenants", "create", "acme")
    assert duplicate.exit_code == 1 and "exists already" in duplicate.stderr
    bad = run("tenants", "create", "no spaces")
    assert bad.exit_code == 1 and "invalid tenant name" in bad.stderr
    unknown = run("tenants", "disable", "ghost")
    assert unknown.exit_code == 1 and "no tenant named 'ghost'" in unknown.stderr
    assert run("tenants", "create", "neg", "--rpm", "-5").exit_code == 2
    assert run("tenants", "update", "acme").exit_code == 2  # nothing to update
    assert run("tenants", "update", "acme", "--rpm", "5", "--unlimited", "rpm").exit_code == 2


def test_keys_create_list_revoke(acme: None) -> None:
    key = create_key("--name", "ci", "--expires-in-days", "30")
    record = auth(key)
    assert record is not None and record.tenant_name == "acme" and record.rpm == 60
    assert record.expires_at is not None

    listing = run("keys", "list", "--tenant", "acme")
    assert listing.exit_code == 0
    assert key[:10] in listing.stdout and key not in listing.output and key[10:] not in listing.output
    assert "ci" in listing.stdout

    revoked = run("keys", "revoke", str(record.key_id))
    assert revoked.exit_code == 0, revoked.output
    assert auth(key) is None
    assert run("keys", "revoke", str(record.key_id)).exit_code == 0  # idempotent


def test_keys_rotate(acme: None) -> None:
    old = create_key()
    record = auth(old)
    assert record is not None
    result = run("keys", "rotate", str(record.key_id), "--grace-seconds", "600")
    assert result.exit_code == 0, result.output
    new = result.stdout.strip()
    assert looks_like_api_key(new) and new != old
    assert auth(new) is not None and auth(old) is not None  # both within the grace period
    zero = run("keys", "rotate", str(auth(new).key_id), "--grace-seconds", "0")  # type: ignore[union-attr]
    assert zero.exit_code == 0 and auth(new) is None and auth(zero.stdout.strip()) is not None


def test_keys_errors(acme: None) -> None:
    unknown = run("keys", "create", "--tenant", "ghost")
    assert unknown.exit_code == 1 and "no tenant named 'ghost'" in unknown.stderr and unknown.stdout == ""
    assert run("keys", "list", "--tenant", "ghost").exit_code == 1
    missing = run("keys", "revoke", "42")
    assert missing.exit_code == 1 and "no API key with id 42" in missing.stderr
    assert run("keys", "rotate", "42").exit_code == 1
    assert run("keys", "revoke", "not-a-number").exit_code == 2
    assert run("keys", "create").exit_code == 2  # --tenant is required
