"""The gateway's app factory: one `setup_*` per concern, resources opened in `cleanup_ctx`.

`create_app(settings)` builds the whole gateway (tests use the real factory with `aiohttp_client`);
`run_gateway(settings)` serves it. The gateway never imports torch: it reaches the engine workers
over HTTP only.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable, Sequence

import aiohttp
from aiohttp import web

from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.settings import AccountingSettings
from accounting.usage_writer import UsageWriter
from gateway.api.errors import error_middleware
from gateway.api.routes import setup_routes
from gateway.auth.invalidation import listen_for_invalidations
from gateway.auth.keys import KeyCache
from gateway.batches.dispatch import setup_batches
from gateway.billing.month_to_date import MonthToDate
from gateway.billing.reconcile import OrphanBiller
from gateway.observability.metrics import setup_metrics
from gateway.observability.tracing import (
    TRACING,
    GatewayTracing,
    gateway_tracing,
    setup_tracing,
    tracing_middleware,
)
from gateway.quotas.admission import add_quota_headers
from gateway.quotas.failover import FailoverQuotaStore
from gateway.quotas.local import LocalQuotaStore
from gateway.quotas.redis_store import RedisQuotaStore
from gateway.quotas.store import QuotaStore
from gateway.settings import GatewaySettings
from gateway.state import ADMIN_KEY, AUTH, BACKGROUND, DB, POOL, QUOTAS, ROUTER, SESSIONS, SETTINGS, WRITER
from gateway.upstream.pool import WorkerPool
from gateway.upstream.router import Router
from workers.wire.files import load_or_create_admin_key, load_or_create_worker_secret

GIL_SWITCH_INTERVAL_S = 0.0005
CleanupContext = Callable[[web.Application], AsyncIterator[None]]


def database_url(settings: GatewaySettings) -> str:
    return AccountingSettings(home=settings.home, database_url=settings.database_url).url


def setup_database(app: web.Application, migrate: bool) -> None:
    async def database(app: web.Application) -> AsyncIterator[None]:
        url = database_url(app[SETTINGS])
        engine = create_db_engine(url)
        if migrate:
            await asyncio.to_thread(upgrade_database, engine)
        app[DB] = engine
        app[SESSIONS] = session_factory(engine)
        yield
        engine.dispose()

    app.cleanup_ctx.append(database)


def setup_auth(app: web.Application) -> None:
    settings = app[SETTINGS]
    app[ADMIN_KEY], _ = load_or_create_admin_key(settings.admin_key, settings.home)

    async def auth(app: web.Application) -> AsyncIterator[None]:
        app[AUTH] = cache = KeyCache(lambda: app[SESSIONS](), settings.auth_cache_ttl_s)
        listener = None
        if settings.redis_url:
            listener = asyncio.create_task(listen_for_invalidations(settings.redis_url, cache))
        yield
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    app.cleanup_ctx.append(auth)


def setup_quotas(app: web.Application) -> None:
    settings = app[SETTINGS]

    async def quotas(app: web.Application) -> AsyncIterator[None]:
        # Monthly budgets are seeded from usage_events + the spool, so a spent budget stays spent
        # across restarts of the gateway and of Redis (gateway/billing/month_to_date.py).
        spent = MonthToDate(app)
        local = LocalQuotaStore(budget_source=spent)
        store: QuotaStore = local
        if settings.redis_url:
            store = FailoverQuotaStore(RedisQuotaStore(settings.redis_url, prefix=settings.quota_prefix,
                                                       budget_source=spent), local,
                                       mode=settings.quota_failure_mode)
        app[QUOTAS] = store
        yield
        await store.close()

    app.cleanup_ctx.append(quotas)
    app.on_response_prepare.append(add_quota_headers)


def setup_metering(app: web.Application) -> None:
    settings = app[SETTINGS]

    async def metering(app: web.Application) -> AsyncIterator[None]:
        # One spool per listening port: a restarted replica finds (and replays) what it spooled.
        spool = settings.home / "spool" / f"usage-{settings.host}-{settings.port}.jsonl"
        spool.parent.mkdir(parents=True, exist_ok=True)
        # No gather delay: rows that arrive while a commit runs form the next group by themselves.
        writer = UsageWriter(app[DB], spool_path=spool, max_delay_s=0.0)
        writer.start()
        app[WRITER] = writer
        app[BACKGROUND] = set()
        yield
        background = app[BACKGROUND]
        if background:  # hang-ups still being billed
            await asyncio.wait(background, timeout=15)
        await asyncio.to_thread(writer.close)

    app.cleanup_ctx.append(metering)


def setup_workers(app: web.Application) -> None:
    settings = app[SETTINGS]
    app[ROUTER] = Router(balance_abs_threshold=settings.router_balance_abs,
                         balance_rel_threshold=settings.router_balance_rel,
                         cache_threshold=settings.router_cache_threshold)

    secret, _ = load_or_create_worker_secret(settings.worker_secret, settings.home)

    async def workers(app: web.Application) -> AsyncIterator[None]:
        # One pooled session for all upstream traffic; no connection cap (the workers queue).
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        app[POOL] = pool = WorkerPool(settings.workers, session, secret=secret,
                                      health_interval_s=settings.health_interval_s, tracer=app[TRACING].tracer)
        # Orphaned usage (requests of a gateway that died mid-stream) is billed on every poll,
        # the first one included: a restarted gateway bills its predecessor's before it serves.
        pool.bill_orphans = OrphanBiller(pool, app[WRITER]).bill
        await pool.start()
        yield
        await pool.stop()
        await session.close()

    app.cleanup_ctx.append(workers)


def create_app(settings: GatewaySettings | None = None, *, migrate: bool = True,
               tracing: GatewayTracing | None = None) -> web.Application:
    """`tracing`: spans go there (tests pass one around an in-memory exporter); default: from settings."""
    settings = settings or GatewaySettings()
    owned = tracing is None
    tracing = tracing if tracing is not None else gateway_tracing(settings)
    # The tracing middleware only when tracing is on (so off costs nothing per request); outside
    # the error middleware, so it sees the final status of every answer.
    middlewares = [tracing_middleware, error_middleware] if tracing.tracer is not None else [error_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=int(settings.max_body_mb * 2**20))
    app[SETTINGS] = settings
    setup_tracing(app, tracing, owned=owned)
    setup_metrics(app)
    setup_database(app, migrate)
    setup_auth(app)
    setup_quotas(app)
    setup_metering(app)
    setup_workers(app)
    setup_batches(app, settings.celery_broker_url)
    setup_routes(app)
    return app


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (it is a dependency off Windows), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_gateway(settings: GatewaySettings, last_contexts: Sequence[CleanupContext] = ()) -> None:
    """Serve the gateway until stopped. `last_contexts` run after every other start-up (the serving
    process's heap freeze, ops/startup_heap.py)."""
    # The event loop shares the GIL with the usage writer's thread. With Python's default 5 ms switch
    # interval, a commit that finished in SQLite could wait up to 5 ms for the GIL before it tells its
    # requests they are billed. At 1,000 req/s the added p99 ranged +3.6 to +85 ms at 5 ms and +3.6 to
    # +11.8 ms at 0.5 ms (ops/bench/RESULTS.md). Serving processes only, as the heap freeze.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app = create_app(settings)
    app.cleanup_ctx.extend(last_contexts)
    web.run_app(app, host=settings.host, port=settings.port, print=None, loop=new_event_loop(),
                keepalive_timeout=settings.read_timeout_s,
                access_log=aiohttp.web.access_logger if settings.access_log else None)
