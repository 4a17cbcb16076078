"""`GET /v1/models`, `GET /v1/models/{model}`, and the catalog lookup every OpenAI route starts with."""

from __future__ import annotations

from aiohttp import web

from gateway.api.errors import ApiError
from gateway.auth.guards import tenant
from gateway.state import POOL
from gateway.upstream.pool import ModelEntry


def model_entry(app: web.Application, name: str) -> ModelEntry:
    """The served model called `name`: 503 while no worker is known yet, 404 naming the served ones."""
    pool = app[POOL]
    entry = pool.models.get(name)
    if entry is not None:
        return entry
    if not pool.models:
        raise ApiError(503, "no engine worker is reachable yet; retry shortly", code="no_worker")
    raise ApiError(404, f"the model '{name}' does not exist; available: {', '.join(sorted(pool.models))}",
                   param="model", code="model_not_found")


def model_object(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tollway"}


@tenant
async def list_models(request: web.Request) -> web.StreamResponse:
    """List the models served by the workers in rotation."""
    data = [model_object(name) for name in sorted(request.app[POOL].models)]
    return web.json_response({"object": "list", "data": data})


@tenant
async def get_model(request: web.Request) -> web.StreamResponse:
    """One model."""
    return web.json_response(model_object(model_entry(request.app, request.match_info["model"]).name))
