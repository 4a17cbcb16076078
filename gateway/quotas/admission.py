"""The admit stage: a tenant's interactive quotas charged before a request reaches a worker, and
settled to what it used once it ends.

A tenant-key request reserves prompt + max_tokens × n tokens (rpm, tpm, concurrency and the
monthly budget checked and charged at once, gateway/quotas/store.py); a refusal is a 429 (or a 503
when the quota store is unreachable in closed mode). A batch line (gateway/batches/lines.py) skips the
interactive quotas but not the monthly budget: it reserves against the budget alone (a budget-only
admission), so a tenant's batches and interactive requests share one budget. The x-ratelimit-*
headers of the decision go on every response of an admitted or refused request (`add_quota_headers`,
an on_response_prepare hook).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from gateway.api.errors import ApiError
from gateway.auth.guards import Caller
from gateway.observability.metrics import METRICS
from gateway.observability.tracing import TRACING
from gateway.quotas.store import KeyScope, Limits, QuotaUnavailable, Ticket
from gateway.state import QUOTAS

QUOTA_HEADERS_KEY = web.RequestKey("quota_headers", dict)


def tenant_scope(tenant_id: int) -> str:
    return f"tenant:{tenant_id}"


def tenant_of_scope(scope: str) -> int | None:
    """The tenant id of a tenant scope (None for any other scope)."""
    kind, _, number = scope.partition(":")
    return int(number) if kind == "tenant" and number.isdigit() else None


@dataclass(frozen=True)
class Admission:
    """An admitted request's hold on its tenant's quotas, until `settle`."""

    request: web.Request
    ticket: Ticket

    async def settle(self, used_tokens: int) -> None:
        """Free the concurrency slot and correct the reserved tokens to the ones used."""
        app = self.request.app
        with app[TRACING].span("gateway.quota.settle"):
            await app[QUOTAS].settle(self.ticket, used_tokens)


def rejection(reason: str | None, headers: dict[str, str], *, reserve: int = 0, tpm: int | None = None) -> ApiError:
    """The 429 for a refused admission; `tpm` is the tightest tokens-per-minute limit on the caller."""
    if reason == "tpm" and tpm is not None and reserve > tpm:  # as OpenAI's "Request too large": say the numbers
        return ApiError(429, f"this request reserves {reserve} tokens (its prompt plus max_tokens × n), more than "
                        f"the tokens-per-minute limit of {tpm}: it can never be admitted; lower max_tokens",
                        type="rate_limit_error", code="rate_limit_exceeded", headers=headers)
    if reason == "budget":
        return ApiError(429, "the monthly token budget of this tenant is used up", type="insufficient_quota",
                        code="insufficient_quota", headers=headers)
    what = {"rpm": "requests per minute", "tpm": "tokens per minute",
            "concurrency": "concurrent requests"}.get(reason or "", "rate")
    return ApiError(429, f"rate limit reached: {what}", type="rate_limit_error", code="rate_limit_exceeded",
                    headers=headers)


async def admit(request: web.Request, caller: Caller, request_id: str, reserve: int) -> Admission:
    """Charge the caller's quotas: a tenant key's every limit, a batch line's monthly budget alone (counted
    even where the tenant has no budget, so that one set later starts from the month's real spend); a 429
    (or 503) when they refuse."""
    record = caller.record
    key = None
    if record is None:
        limits = Limits(monthly_token_budget=caller.batch_budget)
    else:
        limits = Limits(record.tenant_rpm, record.tenant_tpm, record.max_concurrent, record.monthly_token_budget)
        if record.key_rpm is not None or record.key_tpm is not None:
            key = KeyScope(f"key:{record.key_id}", record.key_rpm, record.key_tpm)
    app = request.app
    with app[TRACING].span("gateway.quota.admit", {"tollway.quota.reserved_tokens": reserve}) as span:
        try:
            decision = await app[QUOTAS].admit(tenant_scope(caller.tenant_id), limits, request_id, reserve, key=key,
                                               budget_only=record is None)
        except QuotaUnavailable as exc:
            app[METRICS].rejections.labels(caller.tenant_name, "unavailable").inc()
            raise ApiError(503, "quota service unavailable; retry shortly", code="quota_unavailable",
                           headers={"Retry-After": "1"}) from exc
        if span is not None:
            span.set_attribute("tollway.quota.admitted", decision.admitted)
            if decision.reason:
                span.set_attribute("tollway.quota.reason", decision.reason)
    headers = request[QUOTA_HEADERS_KEY] = decision.headers()
    if not decision.admitted:
        app[METRICS].rejections.labels(caller.tenant_name, decision.reason or "rate").inc()
        tpms = [t for t in (limits.tpm, key.tpm if key is not None else None) if t is not None]
        raise rejection(decision.reason, headers, reserve=reserve, tpm=min(tpms, default=None))
    assert decision.ticket is not None  # an admitted decision carries its ticket
    return Admission(request, decision.ticket)


async def add_quota_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the x-ratelimit-* headers go on every response of an admitted request."""
    headers = request.get(QUOTA_HEADERS_KEY)
    if headers:
        for name, value in headers.items():
            response.headers.setdefault(name, value)
