"""`/admin/dashboard`: the built-in dashboard (admin key), server-rendered by gateway/observability/dashboard_render.py.

How a browser presents the admin key: `/admin/dashboard` without it shows a login form; posting
the key to `POST /admin/dashboard/login` opens a server-side session (gateway/auth/dashboard_session.py)
whose random token is set as an HttpOnly, SameSite=Strict cookie scoped to /admin/dashboard, and
redirects to the dashboard. `GET /admin/dashboard/login` only shows the form: a GET never logs anyone
in, so the key never rides in a URL (a `?key=` is ignored). `POST /admin/dashboard/logout` deletes
the session. A bearer admin key works too (`curl -H 'Authorization: Bearer …'`).

What it shows: this gateway process's live traffic (gateway/observability/live_stats.py), every worker's state
(from the pool's health polls), every tenant's usage this month (SQL), and recent traces as span
waterfalls: this process's ring buffer of finished spans, joined with each worker's spans of the
same traces (`GET /internal/traces`).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from accounting import reports
from accounting.prices import decimal_text
from gateway.api.errors import ApiError
from gateway.api.transactions import in_transaction
from gateway.auth.admin import is_admin_key
from gateway.auth.dashboard_session import COOKIE_PATH, end_session, start_session
from gateway.auth.guards import admin_page
from gateway.observability.dashboard_render import DashboardData, login_page, page, panel
from gateway.observability.metrics import METRICS
from gateway.observability.tracing import TRACING
from gateway.state import ADMIN_KEY, POOL, SETTINGS

MAX_TRACES = 8
HTML = "text/html"


async def _traces(request: web.Request) -> list[list[dict[str, Any]]]:
    recent = request.app[TRACING].recent
    if recent is None:
        return []
    roots = recent.recent_roots(MAX_TRACES)
    trace_ids = [root["trace_id"] for root in roots]
    if not trace_ids:
        return []
    spans = recent.for_traces(trace_ids)
    pool = request.app[POOL]
    fetched = await asyncio.gather(*(pool.recent_spans(w.url, trace_ids) for w in pool.workers.values() if w.healthy))
    spans += [span for worker_spans in fetched for span in worker_spans]
    by_trace: dict[str, dict[str, dict[str, Any]]] = {}  # trace -> span id -> span (each span once)
    for span in spans:
        by_trace.setdefault(span["trace_id"], {})[span["span_id"]] = span
    return [[root] + [s for s in by_trace[root["trace_id"]].values() if s["span_id"] != root["span_id"]]
            for root in roots]


def _tenant_rows(session: Any, month: str) -> list[dict[str, Any]]:
    report = reports.usage_report(session, month)
    return [{"tenant": r.tenant, "model": r.model, "requests": r.requests, "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens, "completion_tokens": r.completion_tokens,
             "cost": decimal_text(r.cost) if r.cost is not None else "unpriced"} for r in report.rows]


async def collect(request: web.Request) -> DashboardData:
    app = request.app
    live = app[METRICS].live
    month = datetime.now(UTC).strftime("%Y-%m")
    tenants = await in_transaction(request, lambda session: _tenant_rows(session, month))
    workers = [{"url": w.url, "healthy": w.healthy, "model": w.model, "in_flight": w.in_flight, "info": w.info}
               for w in app[POOL].workers.values()]
    return DashboardData(live.window(60), live.window(300), live.requests_series(120), workers, month, tenants,
                         await _traces(request), tracing_on=app[TRACING].tracer is not None)


def _login_form() -> web.Response:
    return web.Response(text=login_page(), content_type=HTML, status=401)


def _log_in_again() -> web.Response:
    return web.Response(text="log in again", status=401)


@admin_page(_login_form)
async def dashboard(request: web.Request) -> web.StreamResponse:
    """The dashboard page (admin key: a login form sets a cookie; or a bearer header)."""
    return web.Response(text=page(await collect(request)), content_type=HTML,
                        headers={"Cache-Control": "no-store"})


@admin_page(_log_in_again)
async def dashboard_panel(request: web.Request) -> web.StreamResponse:
    """The dashboard's live part as an HTML fragment (what the page's script refreshes)."""
    return web.Response(text=panel(await collect(request)), content_type=HTML, headers={"Cache-Control": "no-store"})


async def login_form(request: web.Request) -> web.Response:
    """The login form. A GET never logs in (a `?key=` is ignored: keys do not ride in URLs)."""
    error = "Post the admin key with this form; it is not taken from the URL." if "key" in request.query else None
    return web.Response(text=login_page(error), content_type=HTML, headers={"Cache-Control": "no-store"})


async def login(request: web.Request) -> web.Response:
    """Check the admin key (the form's `key` field), open a session and set its cookie."""
    try:
        async with asyncio.timeout(request.app[SETTINGS].read_timeout_s):
            form = await request.post()
    except TimeoutError as exc:
        raise ApiError(408, "the request body was not received in time", code="request_timeout") from exc
    except ValueError:  # not a form (aiohttp's parser)
        form = None
    key = form.get("key") if form is not None else None
    if not isinstance(key, str) or not is_admin_key(key.strip(), request.app[ADMIN_KEY]):
        return web.Response(text=login_page("That is not the admin key."), content_type=HTML, status=401)
    response = web.Response(status=303, headers={"Location": COOKIE_PATH, "Cache-Control": "no-store"})
    await start_session(response, request)
    return response


async def logout(request: web.Request) -> web.Response:
    """End the dashboard's session (on every replica) and clear its cookie."""
    response = web.Response(status=303, headers={"Location": COOKIE_PATH})
    await end_session(response, request)
    return response


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/admin/dashboard", dashboard)
    router.add_get("/admin/dashboard/panel", dashboard_panel)
    router.add_get("/admin/dashboard/login", login_form)
    router.add_post("/admin/dashboard/login", login)
    router.add_post("/admin/dashboard/logout", logout)
