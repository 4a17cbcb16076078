"""Tenants, keys and authentication on a migrated SQLite file."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, inspect, text
from sqlalchemy.orm import Session

from accounting.api_keys import (
    KeyNotFoundError,
    authenticate,
    create_key,
    key_to_dict,
    list_keys,
    revoke_key,
    rotate_key,
)
from accounting.db import create_db_engine, current_revision, session_factory, upgrade_database
from accounting.keys import display_prefix, generate_api_key, hash_api_key, looks_like_api_key
from accounting.settings import AccountingSettings
from accounting.tenants import (
    UNLIMITED,
    AccountingError,
    InvalidQuotaError,
    TenantExistsError,
    TenantNotFoundError,
    create_tenant,
    get_tenant,
    list_tenants,
    set_tenant_disabled,
    tenant_to_dict,
    update_tenant,
)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'tollway.db'}"
    upgrade_database(url)
    engine = create_db_engine(url)
    yield engine
    engine.dispose()


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    with session_factory(engine).begin() as session:
        yield session


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    from accounting.db import alembic_config

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def test_schema_comes_from_the_migrations(engine: Engine) -> None:
    assert current_revision(engine) == head_revision()
    assert {"tenants", "api_keys", "alembic_version"} <= set(inspect(engine).get_table_names())
    with engine.connect() as connection:
        assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
    upgrade_database(engine)  # idempotent
    assert current_revision(engine) == head_revision()


def test_settings_default_to_sqlite_in_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLWAY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TOLLWAY_DATABASE_URL", raising=False)
    assert AccountingSettings().url == f"sqlite:///{tmp_path / 'home' / 'tollway.db'}"
    assert (tmp_path / "home").is_dir()
    monkeypatch.setenv("TOLLWAY_DATABASE_URL", "postgresql+psycopg2://u@h/db")
    assert AccountingSettings().url == "postgresql+psycopg2://u@h/db"


def test_create_list_update_disable_tenants(session: Session) -> None:
    acme = create_tenant(session, "acme", rpm=60, tpm=10_000)
    create_tenant(session, "Beta_2.x-y")
    assert [t.name for t in list_tenants(session)] == ["Beta_2.x-y", "acme"]
    assert (acme.rpm, acme.tpm, acme.max_concurrent, acme.monthly_token_budget) == (60, 10_000, None, None)
    assert acme.created_at.tzinfo is not None and not acme.disabled

    updated = update_tenant(session, "acme", tpm=UNLIMITED, max_concurrent=4)
    assert (updated.rpm, updated.tpm, updated.max_concurrent) == (60, None, 4)  # rpm: None = unchanged
    assert set_tenant_disabled(session, "acme", True).disabled
    assert not update_tenant(session, "acme", disabled=False).disabled

    data = tenant_to_dict(get_tenant(session, "acme"))
    assert data["name"] == "acme" and data["max_concurrent"] == 4 and data["tpm"] is None
    assert datetime.fromisoformat(data["created_at"]).tzinfo is not None


def test_tenant_errors(session: Session) -> None:
    create_tenant(session, "acme")
    with pytest.raises(TenantExistsError, match="exists already"):
        create_tenant(session, "acme")
    for bad in ("", "a b", "x" * 65, "ünï", "a/b"):
        with pytest.raises(InvalidQuotaError, match="invalid tenant name"):
            create_tenant(session, bad)
    with pytest.raises(InvalidQuotaError, match="rpm must be between 0 and"):
        create_tenant(session, "neg", rpm=-1)
    with pytest.raises(InvalidQuotaError, match="whole number"):
        update_tenant(session, "acme", tpm=1.5)  # type: ignore[arg-type]
    with pytest.raises(TenantNotFoundError):
        get_tenant(session, "nope")
    with pytest.raises(TenantNotFoundError):
        set_tenant_disabled(session, "nope", True)
    assert issubclass(TenantNotFoundError, AccountingError) and issubclass(AccountingError, ValueError)


def test_key_format() -> None:
    key = generate_api_key()
    assert re.fullmatch(r"tw-[A-Za-z0-9_-]{43,}", key)
    assert looks_like_api_key(key) and not looks_like_api_key("tw-short") and not looks_like_api_key("sk-" + key[3:])
    assert display_prefix(key) == key[:10] and hash_api_key(key) == hash_api_key(key)
    assert re.fullmatch(r"[0-9a-f]{64}", hash_api_key(key)) and generate_api_key() != key


def test_created_key_authenticates_with_quotas(session: Session) -> None:
    create_tenant(session, "acme", rpm=60, tpm=1000, max_concurrent=2, monthly_token_budget=10**6)
    key, plaintext = create_key(session, "acme", name="ci", tpm=500)
    record = authenticate(session, hash_api_key(plaintext))
    assert record is not None
    assert (record.tenant_name, record.key_id, record.key_prefix) == ("acme", key.id, plaintext[:10])
    assert (record.rpm, record.tpm, record.max_concurrent, record.monthly_token_budget) == (60, 500, 2, 10**6)
    assert record.expires_at is None
    assert authenticate(session, hash_api_key(generate_api_key())) is None
    assert authenticate(session, "not a hash") is None
    data = key_to_dict(key)
    assert data["tenant"] == "acme" and data["status"] == "active" and data["prefix"] == plaintext[:10]
    assert key.key_hash not in data.values() and plaintext not in data.values()
    assert [k.id for k in list_keys(session, "acme")] == [key.id] == [k.id for k in list_keys(session)]
    with pytest.raises(TenantNotFoundError):
        create_key(session, "nope")
    with pytest.raises(TenantNotFoundError):
        list_keys(session, "nope")


def test_revoked_expired_and_disabled_keys_fail(session: Session) -> None:
    create_tenant(session, "acme")
    revoked, revoked_plain = create_key(session, "acme")
    first = revoke_key(session, revoked.id).revoked_at
    assert first is not None and revoke_key(session, revoked.id).revoked_at == first  # idempotent
    assert authenticate(session, hash_api_key(revoked_plain)) is None

    expiry = datetime.now(UTC) + timedelta(days=1)
    _, expiring_plain = create_key(session, "acme", expires_at=expiry)
    assert authenticate(session, hash_api_key(expiring_plain), now=expiry - timedelta(seconds=1)) is not None
    assert authenticate(session, hash_api_key(expiring_plain), now=expiry) is None

    _, plain = create_key(session, "acme")
    set_tenant_disabled(session, "acme", True)
    assert authenticate(session, hash_api_key(plain)) is None
    set_tenant_disabled(session, "acme", False)
    assert authenticate(session, hash_api_key(plain)) is not None

    with pytest.raises(KeyNotFoundError):
        revoke_key(session, 999)
    with pytest.raises(InvalidQuotaError, match="timezone-aware"):
        create_key(session, "acme", expires_at=datetime(2030, 1, 1))


def test_rotation_keeps_the_old_key_for_the_grace_period(session: Session) -> None:
    create_tenant(session, "acme")
    old, old_plain = create_key(session, "acme", name="prod")
    new, new_plain = rotate_key(session, old.id, grace_seconds=3600)
    assert new.id != old.id and new.name == "prod" and new.tenant_id == old.tenant_id and new_plain != old_plain
    now = datetime.now(UTC)
    for plain in (old_plain, new_plain):
        assert authenticate(session, hash_api_key(plain), now=now + timedelta(seconds=3500)) is not None
    later = now + timedelta(seconds=3601)
    assert authenticate(session, hash_api_key(old_plain), now=later) is None
    assert authenticate(session, hash_api_key(new_plain), now=later) is not None

    # An earlier expiry of the old key wins over the grace period; the new key inherits it.
    soon = datetime.now(UTC) + timedelta(seconds=60)
    limited, _ = create_key(session, "acme", expires_at=soon)
    successor, _ = rotate_key(session, limited.id, grace_seconds=3600)
    assert limited.expires_at == soon and successor.expires_at == soon

    revoke_key(session, new.id)
    with pytest.raises(AccountingError, match="revoked"):
        rotate_key(session, new.id, grace_seconds=10)
    with pytest.raises(InvalidQuotaError):
        rotate_key(session, successor.id, grace_seconds=-1)
    with pytest.raises(KeyNotFoundError):
        rotate_key(session, 999, grace_seconds=10)


def test_only_the_hash_is_stored(engine: Engine) -> None:
    with session_factory(engine).begin() as session:
        create_tenant(session, "acme")
        key, plaintext = create_key(session, "acme")
        _, rotated_plain = rotate_key(session, key.id, grace_seconds=10)
    with engine.connect() as connection:
        cells = [str(cell) for table in ("tenants", "api_keys")
                 for row in connection.execute(text(f"SELECT * FROM {table}")) for cell in row]
    dump = "\n".join(cells)
    for secret in (plaintext, rotated_plain):
        assert secret not in dump and secret[10:30] not in dump
        assert hash_api_key(secret) in cells
    with session_factory(engine)() as session:
        assert authenticate(session, hash_api_key(rotated_plain)) is not None
