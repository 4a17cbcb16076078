"""The dashboard's session: how a browser presents the admin key without sending it on every page.

Posting the key to the login form (or opening `/admin/dashboard/login?key=…`) sets an HttpOnly,
SameSite=Strict cookie scoped to /admin/dashboard. The cookie holds an HMAC of the admin key,
never the key, and stops working when the key changes. A bearer admin key works too.
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from gateway.auth.admin import is_admin_key
from gateway.auth.keys import bearer_token

COOKIE = "tollway_dashboard"
COOKIE_PATH = "/admin/dashboard"


def session_token(admin_key: str) -> str:
    return hmac.new(admin_key.encode(), b"tollway-dashboard-session-v1", hashlib.sha256).hexdigest()


def has_dashboard_session(request: web.Request, admin_key: str) -> bool:
    if is_admin_key(bearer_token(request), admin_key):
        return True
    cookie = request.cookies.get(COOKIE, "")
    return bool(cookie) and hmac.compare_digest(cookie.encode(), session_token(admin_key).encode())


def start_session(response: web.StreamResponse, request: web.Request, admin_key: str) -> None:
    response.set_cookie(COOKIE, session_token(admin_key), path=COOKIE_PATH, httponly=True, samesite="Strict",
                        secure=request.secure)


def end_session(response: web.StreamResponse) -> None:
    response.del_cookie(COOKIE, path=COOKIE_PATH)
