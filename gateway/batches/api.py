"""OpenAI's Batches API, scoped to the caller's tenant (a tenant API key):

- `POST /v1/batches` (`input_file_id`, `endpoint`, `completion_window` = `24h`, `metadata`)
- `GET /v1/batches[?limit=&after=]`, `GET /v1/batches/{batch_id}`, `POST /v1/batches/{batch_id}/cancel`

Creation checks the input file again (the limits may have changed since the upload, and the file's
url must match `endpoint`): an invalid input makes a `failed` batch whose `errors` name the lines,
as OpenAI does. A valid one is `validating` until a Celery runner picks it up; its estimated tokens
count against the tenant's queued batch tokens (`TOLLWAY_MAX_QUEUED_BATCH_TOKENS`, 429 beyond).
Another tenant's batch answers 404, like an id that never existed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from sqlalchemy.orm import Session

from accounting import batch_runs, batches, files
from accounting.batch_input import BatchInput, BatchInputError, validate_batch_input
from accounting.file_store import MissingObjectError
from gateway.api.body import query_int, read_json_object
from gateway.api.errors import ApiError, invalid
from gateway.api.transactions import in_transaction
from gateway.auth.guards import CALLER, tenant
from gateway.batches.dispatch import dispatch
from gateway.files.api import file_store
from gateway.state import SETTINGS


def _string_field(body: dict[str, Any], name: str, required: bool = True) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise invalid(f"'{name}' must be a non-empty string", name)
    return value


async def _read_input(request: web.Request, tenant_id: int, file_id: str) -> BatchInput | BatchInputError:
    """The tenant's input file, checked as a batch input with today's limits (404 if not its file)."""
    row = await in_transaction(request, lambda s: files.get_file(s, tenant_id, file_id),
                               not_found_param="input_file_id")
    try:
        data = await asyncio.to_thread(file_store(request.app).get, row.storage_key)
    except MissingObjectError as exc:
        raise ApiError(404, f"the content of file {file_id!r} is missing", param="input_file_id",
                       code="file_not_found") from exc
    settings = request.app[SETTINGS]
    try:
        return await asyncio.to_thread(validate_batch_input, data, max_lines=settings.max_batch_lines,
                                       max_bytes=settings.max_file_bytes)
    except BatchInputError as exc:
        return exc


@tenant
async def create_batch(request: web.Request) -> web.Response:
    """Create a batch from an uploaded input file (purpose=batch)."""
    caller = request[CALLER]
    body = await read_json_object(request)
    file_id = _string_field(body, "input_file_id")
    endpoint = _string_field(body, "endpoint")
    window = _string_field(body, "completion_window")
    assert file_id is not None and endpoint is not None and window is not None
    parsed = await _read_input(request, caller.tenant_id, file_id)
    limit = request.app[SETTINGS].max_queued_batch_tokens

    def work(session: Session) -> dict[str, Any]:
        try:
            batch = batches.create_batch(
                session, tenant_id=caller.tenant_id, key_id=caller.key_id, input_file_id=file_id, endpoint=endpoint,
                completion_window=window, metadata=body.get("metadata"), parsed=parsed, max_queued_tokens=limit)
        except batches.QueuedTokensExceeded as exc:  # raised in here so the transaction rolls back
            raise ApiError(429, str(exc), code="queued_batch_tokens_exceeded", type="rate_limit_error",
                           headers={"x-should-retry": "false"}) from exc
        return batches.batch_to_dict(batch)

    created = await in_transaction(request, work, not_found_param="input_file_id")
    if created["status"] == "validating" and await dispatch(request.app, created["id"]):
        await in_transaction(request, lambda s: batch_runs.mark_dispatched(s, created["id"]))
    return web.json_response(created)


@tenant
async def list_batches(request: web.Request) -> web.Response:
    """List your tenant's batches, newest first (?limit= 1..100, default 20; ?after=BATCH_ID)."""
    caller = request[CALLER]
    limit = query_int(request, "limit", batches.DEFAULT_LIST_LIMIT)
    after = request.query.get("after") or None

    def work(session: Session) -> tuple[list[dict[str, Any]], bool]:
        rows, more = batches.list_batches(session, caller.tenant_id, limit=limit, after=after)
        usage = batches.batch_usage(session, [b.id for b in rows])
        return [batches.batch_to_dict(b, usage[b.id]) for b in rows], more

    data, has_more = await in_transaction(request, work)
    return web.json_response({"object": "list", "data": data, "has_more": has_more,
                              "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None})


@tenant
async def retrieve_batch(request: web.Request) -> web.Response:
    """Retrieve one of your tenant's batches (status, request counts, file ids, usage)."""
    caller = request[CALLER]
    batch_id = request.match_info["batch_id"]

    def work(session: Session) -> dict[str, Any]:
        batch = batches.get_batch(session, caller.tenant_id, batch_id)
        return batches.batch_to_dict(batch, batches.batch_usage(session, [batch.id])[batch.id])

    return web.json_response(await in_transaction(request, work, not_found_param="batch_id"))


@tenant
async def cancel_batch(request: web.Request) -> web.Response:
    """Cancel one of your tenant's batches: lines in flight finish, the rest do not run."""
    caller = request[CALLER]
    batch_id = request.match_info["batch_id"]

    def work(session: Session) -> dict[str, Any]:
        try:
            batch = batches.cancel_batch(session, caller.tenant_id, batch_id)
        except batches.BatchStateError as exc:
            raise ApiError(409, str(exc), param="batch_id", code="batch_not_cancellable") from exc
        return batches.batch_to_dict(batch, batches.batch_usage(session, [batch.id])[batch.id])

    return web.json_response(await in_transaction(request, work, not_found_param="batch_id"))


def add_routes(router: web.UrlDispatcher) -> None:
    """Register the Batches API routes."""
    router.add_post("/v1/batches", create_batch)
    router.add_get("/v1/batches", list_batches)
    router.add_get("/v1/batches/{batch_id}", retrieve_batch)
    router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
