"""Batch lines arriving from the Celery runners: who they are billed to, and at which priority.

A runner POSTs each line to `/v1/chat/completions`, `/v1/completions` or `/v1/responses` like any client, with the
admin key as bearer and `X-Tollway-Batch-Id: batch_…`. The gateway then takes the tenant (and key)
from the batch row, not from the caller; the batch must be `in_progress` or `cancelling` (lines in
flight when a cancel arrives finish). Such a request runs at the worker's `batch` priority, is
metered with the batch id (so billing applies the batch price), and is not charged to the tenant's
interactive quotas (rpm, tpm, concurrency): batches are bounded by the queued batch-token limit at
creation instead. The tenant's monthly token budget does govern them: each line reserves against it, and
a line it cannot fit is answered 429 `insufficient_quota` (the runner records it as the line's error).
A tenant disabled meanwhile gets its lines refused (403).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from sqlalchemy.orm import Session

from accounting.models import Batch, Tenant
from gateway.api.errors import ApiError
from gateway.api.transactions import in_transaction
from gateway.auth.admin import check_admin
from gateway.state import ADMIN_KEY
from workers.wire.batches import BATCH_HEADER

RUNNING = ("in_progress", "cancelling")


@dataclass(frozen=True)
class BatchCaller:
    """A batch line's billing identity, from its batch row."""

    batch_id: str
    tenant_id: int
    key_id: int | None
    tenant_name: str = ""
    weight: float = 1.0  # the tenant's scheduling weight
    monthly_token_budget: int | None = None  # the tenant's: a line reserves against it (gateway/quotas/admission.py)


async def batch_caller(request: web.Request) -> BatchCaller | None:
    """The batch a request belongs to (None for ordinary requests); 401/403/404/409 when it may not run."""
    batch_id = request.headers.get(BATCH_HEADER)
    if batch_id is None:
        return None
    check_admin(request, request.app[ADMIN_KEY])  # only runners (holding the admin key) speak for a batch

    def lookup(session: Session) -> BatchCaller:
        batch = session.get(Batch, batch_id)
        if batch is None:
            raise ApiError(404, f"no such batch: {batch_id!r}", param=BATCH_HEADER, code="batch_not_found")
        tenant = session.get(Tenant, batch.tenant_id)
        if tenant is None or tenant.disabled:
            raise ApiError(403, "the batch's tenant is disabled", code="tenant_disabled")
        if batch.status not in RUNNING:
            raise ApiError(409, f"batch {batch_id} is {batch.status}: its lines no longer run",
                           code="batch_not_running")
        if batch.endpoint != request.path:
            raise ApiError(400, f"batch {batch_id} runs {batch.endpoint}, not {request.path}", code="wrong_endpoint")
        return BatchCaller(batch.id, batch.tenant_id, batch.key_id, tenant.name, tenant.weight,
                           tenant.monthly_token_budget)

    return await in_transaction(request, lookup)
