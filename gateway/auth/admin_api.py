"""Admin API under /admin/v1 (admin key only): tenants and API keys.

Views are thin: they validate JSON, call `accounting.tenants` or `accounting.api_keys` in a worker
thread (the caller owns the transaction: one commit per request) and map accounting errors to HTTP
errors. Anything that can un-authorise a key (revoke, rotate, disable, quota change) drops the key
cache here and on every replica through Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from aiohttp import web
from sqlalchemy.orm import Session

from accounting import api_keys, tenants
from gateway.api.body import read_json_object
from gateway.api.errors import ApiError, invalid
from gateway.api.transactions import in_transaction
from gateway.auth.guards import admin
from gateway.state import AUTH, SETTINGS
from workers.wire.key_events import publish_invalidation

T = TypeVar("T")
QUOTAS = ("rpm", "tpm", "max_concurrent", "monthly_token_budget")


async def _in_transaction(request: web.Request, work: Callable[[Session], T], *, invalidates: bool = False) -> T:
    result = await in_transaction(request, work)
    if invalidates:
        request.app[AUTH].invalidate()
        await asyncio.to_thread(publish_invalidation, request.app[SETTINGS].redis_url)
    return result


def _weight(body: dict[str, Any]) -> float:
    """The body's scheduling weight (a number above 0; 400 naming `weight` otherwise)."""
    try:
        return tenants.check_weight(body["weight"])
    except tenants.InvalidQuotaError as exc:
        raise invalid(str(exc), "weight") from exc


def _quota_updates(body: dict[str, Any]) -> dict[str, Any]:
    unknown = set(body) - {*QUOTAS, "disabled", "weight"}
    if unknown:
        raise invalid(f"unknown fields: {', '.join(sorted(unknown))}", sorted(unknown)[0])
    updates: dict[str, Any] = {}
    for field in QUOTAS:
        if field in body:  # JSON null removes the limit
            updates[field] = tenants.UNLIMITED if body[field] is None else body[field]
    if "disabled" in body:
        if not isinstance(body["disabled"], bool):
            raise invalid("'disabled' must be a boolean", "disabled")
        updates["disabled"] = body["disabled"]
    if "weight" in body:
        updates["weight"] = _weight(body)
    return updates


@admin
async def list_tenants(request: web.Request) -> web.Response:
    """List tenants with their quotas."""
    rows = await _in_transaction(request, lambda s: [tenants.tenant_to_dict(t) for t in tenants.list_tenants(s)])
    return web.json_response({"object": "list", "data": rows})


@admin
async def create_tenant(request: web.Request) -> web.Response:
    """Create a tenant: {name, rpm?, tpm?, max_concurrent?, monthly_token_budget?, weight?=1}."""
    body = await read_json_object(request)
    unknown = set(body) - {"name", "weight", *QUOTAS}
    if unknown:
        raise invalid(f"unknown fields: {', '.join(sorted(unknown))}", sorted(unknown)[0])
    quotas = {field: body.get(field) for field in QUOTAS}
    weight = _weight(body) if "weight" in body else 1.0
    row = await _in_transaction(request, lambda s: tenants.tenant_to_dict(
        tenants.create_tenant(s, tenants.check_tenant_name(body.get("name")), **quotas, weight=weight)))
    return web.json_response(row, status=201)


@admin
async def get_tenant(request: web.Request) -> web.Response:
    """One tenant."""
    name = request.match_info["name"]
    return web.json_response(await _in_transaction(request, lambda s: tenants.tenant_to_dict(tenants.get_tenant(s, name))))


@admin
async def update_tenant(request: web.Request) -> web.Response:
    """Change quotas (null = unlimited), the scheduling weight, or disable/enable: {rpm?, tpm?, ..., weight?, disabled?}."""
    name, updates = request.match_info["name"], _quota_updates(await read_json_object(request))
    row = await _in_transaction(
        request, lambda s: tenants.tenant_to_dict(tenants.update_tenant(s, name, **updates)), invalidates=True)
    return web.json_response(row)


@admin
async def list_keys(request: web.Request) -> web.Response:
    """List API keys (never the keys themselves), optionally ?tenant=NAME."""
    tenant = request.query.get("tenant")
    rows = await _in_transaction(request, lambda s: [api_keys.key_to_dict(k) for k in api_keys.list_keys(s, tenant)])
    return web.json_response({"object": "list", "data": rows})


def _expiry(body: dict[str, Any]) -> datetime | None:
    days = body.get("expires_in_days")
    if days is None:
        return None
    if isinstance(days, bool) or not isinstance(days, int | float) or days <= 0:
        raise invalid("'expires_in_days' must be a positive number", "expires_in_days")
    return datetime.now(UTC) + timedelta(days=days)


@admin
async def create_key(request: web.Request) -> web.Response:
    """Create a key for a tenant: {tenant, name?, expires_in_days?, rpm?, tpm?} (rpm / tpm: the key's
    own limits, counted on the key within the tenant's). The key is in this answer only."""
    body = await read_json_object(request)
    tenant, name, expires_at = body.get("tenant"), body.get("name"), _expiry(body)
    if not isinstance(tenant, str):
        raise invalid("'tenant' (a tenant name) is required", "tenant")
    rpm, tpm = body.get("rpm"), body.get("tpm")

    def work(session: Session) -> dict[str, Any]:
        key, plaintext = api_keys.create_key(session, tenant, name=name, expires_at=expires_at, rpm=rpm, tpm=tpm)
        return {**api_keys.key_to_dict(key), "key": plaintext}

    return web.json_response(await _in_transaction(request, work), status=201)


def _key_id(request: web.Request) -> int:
    try:
        return int(request.match_info["key_id"])
    except ValueError as exc:
        raise ApiError(404, "no such API key", code="key_not_found") from exc


@admin
async def revoke_key(request: web.Request) -> web.Response:
    """Revoke a key at once, on every replica."""
    key_id = _key_id(request)
    row = await _in_transaction(request, lambda s: api_keys.key_to_dict(api_keys.revoke_key(s, key_id)), invalidates=True)
    return web.json_response(row)


@admin
async def rotate_key(request: web.Request) -> web.Response:
    """Replace a key: {grace_seconds?=3600}; the old key keeps working for the grace period."""
    key_id, body = _key_id(request), await read_json_object(request)
    grace = body.get("grace_seconds", 3600)

    def work(session: Session) -> dict[str, Any]:
        key, plaintext = api_keys.rotate_key(session, key_id, grace)
        return {**api_keys.key_to_dict(key), "key": plaintext}

    return web.json_response(await _in_transaction(request, work, invalidates=True), status=201)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/admin/v1/tenants", list_tenants)
    router.add_post("/admin/v1/tenants", create_tenant)
    router.add_get("/admin/v1/tenants/{name}", get_tenant)
    router.add_patch("/admin/v1/tenants/{name}", update_tenant)
    router.add_get("/admin/v1/keys", list_keys)
    router.add_post("/admin/v1/keys", create_key)
    router.add_post("/admin/v1/keys/{key_id}/revoke", revoke_key)
    router.add_delete("/admin/v1/keys/{key_id}", revoke_key)
    router.add_post("/admin/v1/keys/{key_id}/rotate", rotate_key)
