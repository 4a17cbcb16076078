"""The dashboard's session: how a browser presents the admin key without sending it on every page.

Posting the admin key to the login form (`POST /admin/dashboard/login`, the only way to log in: a
GET never does, and the key never rides in a URL) opens a server-side session
(accounting/dashboard_sessions.py: a SQL row every gateway replica sees) and sets its random token
as a cookie: HttpOnly, SameSite=Strict, path /admin/dashboard, Max-Age the session's lifetime
(TOLLWAY_DASHBOARD_SESSION_TTL_S), and Secure when the request came over https (directly, or per
the `X-Forwarded-Proto: https` of a TLS-terminating proxy: a forged one only makes the cookie
stricter). The cookie holds neither the key nor anything derived from it. A session ends when it
expires, at logout (its row is deleted, on every replica at once), or when the admin key changes.
A bearer admin key works on every dashboard route too.
"""

from __future__ import annotations

from datetime import timedelta

from aiohttp import web

from accounting import dashboard_sessions
from gateway.api.transactions import in_transaction
from gateway.auth.admin import is_admin_key
from gateway.auth.keys import bearer_token
from gateway.state import ADMIN_KEY, SETTINGS

COOKIE = "tollway_dashboard"
COOKIE_PATH = "/admin/dashboard"


def _is_https(request: web.Request) -> bool:
    return request.secure or request.headers.get("X-Forwarded-Proto", "").strip().lower() == "https"


async def has_dashboard_session(request: web.Request) -> bool:
    """Whether the request carries the admin key as its bearer, or the cookie of a live session."""
    admin_key = request.app[ADMIN_KEY]
    if is_admin_key(bearer_token(request), admin_key):
        return True
    token = request.cookies.get(COOKIE, "")
    if not token or len(token) > dashboard_sessions.MAX_TOKEN_LENGTH:
        return False
    return await in_transaction(request, lambda session: dashboard_sessions.session_is_valid(session, token, admin_key))


async def start_session(response: web.StreamResponse, request: web.Request) -> None:
    """Open a session for a caller who presented the admin key, and set its cookie on `response`."""
    ttl = timedelta(seconds=request.app[SETTINGS].dashboard_session_ttl_s)
    admin_key = request.app[ADMIN_KEY]
    token, _ = await in_transaction(request, lambda session: dashboard_sessions.open_session(session, admin_key, ttl))
    response.set_cookie(COOKIE, token, path=COOKIE_PATH, max_age=int(ttl.total_seconds()), httponly=True,
                        samesite="Strict", secure=_is_https(request))


async def end_session(response: web.StreamResponse, request: web.Request) -> None:
    """Delete the request's session (if any) and clear its cookie."""
    token = request.cookies.get(COOKIE, "")
    if token:
        await in_transaction(request, lambda session: dashboard_sessions.close_session(session, token))
    response.del_cookie(COOKIE, path=COOKIE_PATH)
