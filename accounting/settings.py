"""Settings of the accounting side (env prefix TOLLWAY_)."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class AccountingSettings(BaseSettings):
    """Where the accounting database lives.

    `TOLLWAY_DATABASE_URL` wins (e.g. PostgreSQL in production); otherwise a SQLite file in
    `TOLLWAY_HOME` is used.
    """

    model_config = SettingsConfigDict(env_prefix="TOLLWAY_", extra="ignore")

    home: Path = Path(".tollway")
    """State folder; the default SQLite database is `{home}/tollway.db`."""
    database_url: str | None = None
    """SQLAlchemy URL of the accounting database; None = SQLite in `home`."""
    db_connect_timeout_s: float = 5.0
    """PostgreSQL: longest wait for a new connection (libpq `connect_timeout`, whole seconds, at least 2)."""
    db_statement_timeout_s: float = 30.0
    """PostgreSQL: longest run of one statement (server-side `statement_timeout`); 0 = no limit.
    Migrations lift it for their own transaction."""

    @property
    def url(self) -> str:
        """The database URL to use; creates `home` when falling back to the default SQLite file."""
        if self.database_url:
            return self.database_url
        self.home.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{self.home / 'tollway.db'}"
