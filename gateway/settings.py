"""Settings of the gateway (env prefix TOLLWAY_)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic_settings import SettingsConfigDict

from gateway.upstream.router import BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD, CACHE_THRESHOLD
from workers.wire.batches import broker_url
from workers.wire.telemetry import TracingSettings


class GatewaySettings(TracingSettings):
    """Also the tracing settings (workers/wire/telemetry.py: TOLLWAY_TRACING, TOLLWAY_OTLP_ENDPOINT, ...)."""

    model_config = SettingsConfigDict(env_prefix="TOLLWAY_", extra="ignore")

    home: Path = Path(".tollway")
    """State folder: the SQLite database and admin.key live here."""
    host: str = "127.0.0.1"
    port: int = 8000
    worker_urls: str = "http://127.0.0.1:8100"
    """Comma-separated base URLs of the engine workers."""
    admin_key: str | None = None
    """Admin key; when unset one is generated into $TOLLWAY_HOME/admin.key (mode 600)."""
    dashboard_session_ttl_s: float = 12 * 3600
    """How long a dashboard login lasts (its server-side session and its cookie)."""
    worker_secret: str | None = None
    """The workers' shared secret, sent as the bearer of every call to a worker; unset =
    `$TOLLWAY_HOME/worker.secret`, created there if absent (workers/wire/files.py)."""
    redis_url: str | None = None
    """Redis for shared quotas and key-revocation broadcasts; unset = in-process only."""
    quota_failure_mode: Literal["open", "closed"] = "open"
    """With Redis unreachable: "open" enforces each replica's own in-process limits, "closed"
    refuses requests (503) until Redis is back. Either way it reconnects by itself."""
    quota_prefix: str = "tollway"
    """Prefix of the quota keys in Redis (several deployments can share one Redis)."""
    database_url: str | None = None
    """SQLAlchemy URL; unset = SQLite at $TOLLWAY_HOME/tollway.db."""
    max_body_mb: float = 4.0
    """Largest accepted request body (larger → 413); file uploads have their own limit."""
    read_timeout_s: float = 30.0
    """Slow-loris guard: a connection that has not sent a request's headers within this (aiohttp's
    keep-alive timer, also the idle keep-alive limit) is closed, and a JSON body not fully received
    within this after its headers gets a 408 and a closed connection."""
    max_file_bytes: int = 100 * 2**20
    """Largest file accepted by POST /v1/files (larger → 413)."""
    upload_timeout_s: float = 600.0
    """Longest a file upload (POST /v1/files) may take to arrive in full (then 408); it must also
    keep making progress: no read of it waits longer than `read_timeout_s`."""
    max_batch_lines: int = 50_000
    """Most requests in one batch input file."""
    max_queued_batch_tokens: int = 10_000_000
    """Per tenant: the estimated tokens (prompt + max_tokens of every line) of its unfinished batches;
    POST /v1/batches beyond it is a 429. 0 = unlimited."""
    broker_url: str | None = None
    """Celery broker of the batch jobs; unset = `redis_url` if set, else SQLite in $TOLLWAY_HOME."""
    auth_cache_ttl_s: float = 5.0
    """How long a key lookup is trusted without Redis invalidation."""
    health_interval_s: float = 1.0
    """How often every worker's /internal/info is polled."""
    max_attempts: int = 3
    """Workers tried for one request that has not begun streaming."""
    router_balance_abs: int = BALANCE_ABS_THRESHOLD
    router_balance_rel: float = BALANCE_REL_THRESHOLD
    router_cache_threshold: float = CACHE_THRESHOLD
    """Cache-aware routing (gateway/upstream/router.py)."""
    access_log: bool = False

    @property
    def celery_broker_url(self) -> str:
        """The broker batch jobs are queued on (the rule every process shares: workers/wire/batches.py)."""
        return broker_url(self.broker_url, self.redis_url, self.home)

    @property
    def workers(self) -> list[str]:
        return [url.strip().rstrip("/") for url in self.worker_urls.split(",") if url.strip()]
