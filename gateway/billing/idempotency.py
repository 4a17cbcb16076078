"""`Idempotency-Key`: a retried request gets the stored response and is not billed twice.

Keys are per tenant. The first request with a key claims it (a row with no response yet); its
response is stored in the same transaction as its usage row (see `gateway/billing/meter.py`), so a
request is either billed with its response stored, or neither. A retry with the same key and the
same body replays the stored response; with a different body it is a 422; while the first is
still running it is a 409. A claim whose request failed before being billed is released so the
client can retry; a claim left by a crashed gateway is taken over after `STALE_CLAIM_S`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta

import orjson
from aiohttp import web
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from accounting.models import IdempotentResponse, utcnow
from gateway.api.errors import ApiError
from gateway.api.transactions import in_transaction

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255
STALE_CLAIM_S = 600.0


@dataclass(frozen=True)
class Claim:
    """This request owns `key` for `tenant_id`; its response is stored with its usage row."""

    tenant_id: int
    key: str


@dataclass(frozen=True)
class Replay:
    status: int
    content_type: str
    body: bytes

    def response(self) -> web.Response:
        return web.Response(body=self.body, status=self.status, headers={
            "Content-Type": self.content_type, "Idempotent-Replayed": "true"})


def body_hash(body: object) -> str:
    """Hash of the parsed JSON body (key order does not matter)."""
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _claim_or_replay(session: Session, tenant_id: int, key: str, digest: str, request_id: str) -> Claim | Replay:
    row = session.scalar(select(IdempotentResponse).where(
        IdempotentResponse.tenant_id == tenant_id, IdempotentResponse.key == key).with_for_update())
    if row is None:
        session.add(IdempotentResponse(tenant_id=tenant_id, key=key, request_hash=digest, request_id=request_id))
        try:
            session.flush()
        except IntegrityError as exc:  # a concurrent request claimed it first
            raise ApiError(409, "a request with this Idempotency-Key is in progress; retry later",
                           param=HEADER, code="idempotency_key_in_use") from exc
        return Claim(tenant_id, key)
    if row.request_hash != digest:
        raise ApiError(422, "this Idempotency-Key was used with a different request body", param=HEADER,
                       code="idempotency_key_reused")
    if row.body is not None and row.status_code is not None:
        return Replay(row.status_code, row.content_type or "application/json", row.body)
    if utcnow() - row.created_at < timedelta(seconds=STALE_CLAIM_S):
        raise ApiError(409, "a request with this Idempotency-Key is in progress; retry later",
                       param=HEADER, code="idempotency_key_in_use")
    row.request_id, row.created_at = request_id, utcnow()  # abandoned by a crashed gateway: take it over
    return Claim(tenant_id, key)


async def claim_or_replay(request: web.Request, tenant_id: int, body: object,
                          request_id: str) -> Claim | Replay | None:
    """None when the request has no Idempotency-Key."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not key or len(key) > MAX_KEY_LENGTH:
        raise ApiError(400, f"{HEADER} must be 1 to {MAX_KEY_LENGTH} characters", param=HEADER)
    digest = body_hash(body)
    return await in_transaction(request, lambda session: _claim_or_replay(session, tenant_id, key, digest, request_id))


def _release(session: Session, claim: Claim) -> None:
    session.execute(delete(IdempotentResponse).where(
        IdempotentResponse.tenant_id == claim.tenant_id, IdempotentResponse.key == claim.key,
        IdempotentResponse.body.is_(None)))


async def release(request: web.Request, claim: Claim) -> None:
    """Give the key back after a failure that billed nothing, so a retry can run."""
    await in_transaction(request, lambda session: _release(session, claim))
