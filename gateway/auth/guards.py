"""Who may call a view: every route's handler is wrapped in exactly one of these guards.

A guard checks the caller before the view reads anything, so a wrong key gets a 401, never a 400
or 404 that tells it about the body or the ids it sent. Tenant guards leave the `Caller` on the
request (`request[CALLER]`): who the request is billed to and, for a tenant key, its quotas.

- `tenant`: a tenant API key (bearer, or Azure-style `api-key`).
- `admin`: the admin key as bearer; `admin_page(refused)` for the dashboard's pages also takes its
  session cookie and answers a refusal with `refused()` (the login form).
- `tenant_or_batch_line`: the OpenAI generation routes. A request carrying `X-Tollway-Batch-Id`
  comes from a batch runner holding the admin key, and is billed to the batch's tenant
  (gateway/batches/lines.py); any other is a tenant's.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from accounting.api_keys import AuthRecord
from gateway.auth.admin import check_admin
from gateway.auth.dashboard_session import has_dashboard_session
from gateway.auth.keys import bearer_token
from gateway.batches.lines import batch_caller
from gateway.observability.tracing import TRACING
from gateway.state import ADMIN_KEY, AUTH

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Caller:
    """Who a request is billed to."""

    tenant_id: int
    tenant_name: str
    key_id: int | None
    record: AuthRecord | None = None  # a tenant key's record (its quotas); None for a batch line
    batch_id: str | None = None  # a batch runner's line: billed at the batch price, no interactive quotas
    batch_budget: int | None = None  # a batch line's tenant's monthly token budget (None: unlimited)
    weight: float = 1.0  # the tenant's scheduling weight (sent to the worker with each request)

    @classmethod
    def of_key(cls, record: AuthRecord) -> Caller:
        return cls(record.tenant_id, record.tenant_name, record.key_id, record, weight=record.weight)


CALLER = web.RequestKey("caller", Caller)


def tenant(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        request[CALLER] = Caller.of_key(await request.app[AUTH].authenticate(bearer_token(request)))
        return await handler(request)

    return guarded


def tenant_or_batch_line(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        with request.app[TRACING].span("gateway.auth"):
            batch = await batch_caller(request)
            if batch is not None:
                caller = Caller(batch.tenant_id, batch.tenant_name, batch.key_id, batch_id=batch.batch_id,
                                batch_budget=batch.monthly_token_budget, weight=batch.weight)
            else:
                caller = Caller.of_key(await request.app[AUTH].authenticate(bearer_token(request)))
        request[CALLER] = caller
        return await handler(request)

    return guarded


def admin(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        check_admin(request, request.app[ADMIN_KEY])
        return await handler(request)

    return guarded


def admin_page(refused: Callable[[], web.Response]) -> Callable[[Handler], Handler]:
    """`admin` for the dashboard's pages: the session cookie is accepted too, and a refusal is
    `refused()` (the login form) rather than a JSON error."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def guarded(request: web.Request) -> web.StreamResponse:
            if not await has_dashboard_session(request):
                return refused()
            return await handler(request)

        return guarded

    return wrap
