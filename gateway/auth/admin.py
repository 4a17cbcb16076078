"""The admin key: the operator's credential for /admin/v1, /metrics, the dashboard and batch runners.

It comes from TOLLWAY_ADMIN_KEY or `$TOLLWAY_HOME/admin.key` (workers/wire/files.py) and is
compared in constant time.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from gateway.api.errors import ApiError
from gateway.auth.keys import bearer_token


def is_admin_key(candidate: str | None, admin_key: str) -> bool:
    return candidate is not None and hmac.compare_digest(candidate.encode(), admin_key.encode())


def check_admin(request: web.Request, admin_key: str) -> None:
    if not is_admin_key(bearer_token(request), admin_key):
        raise ApiError(401, "admin routes need the admin key (TOLLWAY_ADMIN_KEY or $TOLLWAY_HOME/admin.key)",
                       code="invalid_admin_key")
