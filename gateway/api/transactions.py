"""Running accounting work from a view: one transaction in a worker thread, errors mapped to HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web
from sqlalchemy.orm import Session

from accounting.tenants import AccountingError, NotFoundError, TenantExistsError
from gateway.api.errors import ApiError, invalid
from gateway.state import SESSIONS

T = TypeVar("T")


async def in_transaction(request: web.Request, work: Callable[[Session], T], *,
                         not_found_param: str | None = None) -> T:
    """`work(session)` in one committed transaction, off the event loop.

    Not found → 404 (with the error's code, and `not_found_param` as the parameter), an existing
    tenant → 409, any other accounting error → 400 naming the field at fault where it knows it.
    """
    def run() -> T:
        with request.app[SESSIONS]() as session, session.begin():
            return work(session)

    try:
        return await asyncio.to_thread(run)
    except NotFoundError as exc:
        raise ApiError(404, str(exc), param=not_found_param, code=exc.code) from exc
    except TenantExistsError as exc:
        raise ApiError(409, str(exc), code="tenant_exists") from exc
    except AccountingError as exc:
        raise invalid(str(exc), exc.field) from exc
