"""Every route of the gateway, in one table; each view is guarded (gateway/auth/guards.py).

| prefix          | who                       | where                                        |
| --------------- | ------------------------- | -------------------------------------------- |
| /v1/…completions| tenant key or batch line  | gateway/openai/views.py                      |
| /v1/responses   | tenant key or batch line  | gateway/openai/views.py, responses_api.py    |
| /v1/models      | tenant key                | gateway/openai/models.py                     |
| /v1/files       | tenant key                | gateway/files/api.py                         |
| /v1/batches     | tenant key                | gateway/batches/api.py                       |
| /v1/usage       | tenant key                | gateway/billing/usage_api.py                 |
| /admin/v1/…     | admin key                 | gateway/auth/admin_api.py, billing/usage_api |
| /admin/dashboard| admin key or its cookie   | gateway/observability/dashboard.py           |
| /metrics        | admin key                 | gateway/observability/metrics.py             |
| /healthz, /readyz, /openapi.json | anyone   | here                                         |

`/healthz` is liveness (the process answers; 200 whatever the workers do), `/readyz` readiness
(200 once at least one engine worker is in rotation, 503 before and whenever none is; `?model=NAME`
also waits for a worker of that model): what a load balancer or `tollway up` waits for.
"""

from __future__ import annotations

from aiohttp import web

from gateway.api.errors import invalid
from gateway.api.openapi import build_openapi
from gateway.auth import admin_api
from gateway.batches import api as batches_api
from gateway.billing import usage_api
from gateway.files import api as files_api
from gateway.observability import dashboard
from gateway.openai import models, views
from gateway.state import POOL


def _worker_counts(request: web.Request) -> dict[str, int]:
    workers = request.app[POOL].workers.values()
    return {"workers_healthy": sum(w.healthy for w in workers), "workers_total": len(workers)}


async def healthz(request: web.Request) -> web.Response:
    """Liveness of the gateway (always 200 while it runs), with how many workers are in rotation."""
    return web.json_response({"status": "ok", **_worker_counts(request)})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 once at least one engine worker is in rotation, else 503 `not_ready`. With
    `?model=NAME` (repeatable), also one worker of each named model (what `tollway up --model` waits
    for); the 503 then lists the missing ones in `models_missing`."""
    counts = _worker_counts(request)
    if counts["workers_healthy"] == 0:
        return web.json_response({"status": "not_ready", "reason": "no engine worker is in rotation yet",
                                  **counts}, status=503, headers={"Retry-After": "1"})
    asked = request.query.getall("model", [])
    if any(not name.strip() for name in asked):
        raise invalid("model must name a model (an empty name never becomes ready)", param="model")
    serving = {w.model for w in request.app[POOL].workers.values() if w.healthy}
    missing = sorted(set(asked) - serving)
    if missing:
        return web.json_response({"status": "not_ready", "reason": "a model asked for has no engine worker in "
                                  "rotation yet", "models_missing": missing, **counts},
                                 status=503, headers={"Retry-After": "1"})
    return web.json_response({"status": "ready", **counts})


async def openapi(request: web.Request) -> web.Response:
    """This document: every route of the gateway."""
    return web.json_response(build_openapi(request.app))


def setup_routes(app: web.Application) -> None:
    router = app.router
    router.add_get("/healthz", healthz)
    router.add_get("/readyz", readyz)
    router.add_get("/openapi.json", openapi)
    router.add_get("/v1/models", models.list_models)
    router.add_get("/v1/models/{model}", models.get_model)
    router.add_post("/v1/chat/completions", views.chat_completions)
    router.add_post("/v1/completions", views.completions)
    router.add_post("/v1/responses", views.responses)
    admin_api.add_routes(router)
    usage_api.add_routes(router)
    files_api.add_routes(router)
    batches_api.add_routes(router)
    dashboard.add_routes(router)
