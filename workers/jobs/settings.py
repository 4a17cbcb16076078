"""Settings of the batch runners (env prefix TOLLWAY_), read when a task runs, never at import."""

from __future__ import annotations

import functools
from pathlib import Path

from pydantic_settings import SettingsConfigDict

from workers.wire.batches import broker_url
from workers.wire.files import read_admin_key
from workers.wire.telemetry import TracingSettings


class JobSettings(TracingSettings):
    """Also the tracing settings (workers/wire/telemetry.py): run tasks and batch lines become spans."""

    model_config = SettingsConfigDict(env_prefix="TOLLWAY_", extra="ignore")

    home: Path = Path(".tollway")
    """State folder: the SQLite database, the file store (`files/`), admin.key, the embedded broker."""
    redis_url: str | None = None
    broker_url: str | None = None
    """Celery broker; unset = `redis_url` if set, else SQLite in $TOLLWAY_HOME (as the gateway)."""
    gateway_url: str = "http://127.0.0.1:8000"
    """Where runners send batch lines (the gateway's own /v1 routes)."""
    admin_key: str | None = None
    """The gateway's admin key; unset = read from $TOLLWAY_HOME/admin.key."""
    batch_line_concurrency: int = 16
    """Lines of one batch in flight at once (the engine batches them continuously)."""
    batch_lease_s: float = 60.0
    """A runner's lease on a batch; renewed every few seconds while it runs."""
    batch_step_s: float = 300.0
    """A run task works on one batch at most this long, then queues a continuation (batches take turns)."""
    batch_line_timeout_s: float = 600.0
    """Longest wait for one line's answer before it is retried."""
    batch_sweep_interval_s: float = 30.0
    """How often beat runs the sweep that re-queues batches whose runner vanished."""
    batch_redispatch_after_s: float = 600.0
    """A queued run task not started within this long is presumed lost and queued again."""

    @property
    def celery_broker_url(self) -> str:
        """The broker every process shares (workers/wire/batches.py)."""
        return broker_url(self.broker_url, self.redis_url, self.home)

    def resolved_admin_key(self) -> str:
        return read_admin_key(self.admin_key, self.home)


@functools.cache
def job_settings() -> JobSettings:
    """The process's settings (read once, on first use)."""
    return JobSettings()
