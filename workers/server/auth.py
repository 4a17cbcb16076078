"""The worker's door: every `/internal/*` route demands the gateway's credential.

The credential is the workers' shared secret (TOLLWAY_WORKER_SECRET or `$TOLLWAY_HOME/worker.secret`:
workers/wire/files.py) as `Authorization: Bearer <secret>`, compared in constant time. A request
without it is answered 401 `{"error": {"message", "type"}}` before any handler runs, so the
generate channel's websocket is refused before its upgrade, and nothing of the body is read.

What this guarantees: only a gateway (which holds the secret) can run generate requests, and so
only the gateway chooses a request's cache namespace (the tenant isolation of the prefix cache
rests on that). `/healthz` and `/metrics` stay open: liveness probes and Prometheus scrapes carry
no credential, and the worker's metrics are aggregates without tenant names or namespaces.

Both the real worker (workers/server/app.py) and its test double (ops/fake_worker.py) use this
middleware, so the gateway's tests go through the same door.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from workers.server.errors import error

INTERNAL_PREFIX = "/internal/"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def bearer_matches(header: str | None, secret: str) -> bool:
    """Whether an Authorization header is `Bearer <secret>` (constant time in the secret)."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), secret.encode())


def internal_auth(secret: Callable[[], str]) -> Middleware:
    """A middleware refusing `/internal/*` requests without the secret; `secret()` is read per
    request (the test double may change it). An empty secret refuses everything."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(INTERNAL_PREFIX) or request.path == INTERNAL_PREFIX.rstrip("/"):
            expected = secret()
            if not expected or not bearer_matches(request.headers.get("Authorization"), expected):
                return error(401, "the worker's internal API needs the gateway's credential "
                                  "(Authorization: Bearer <TOLLWAY_WORKER_SECRET or $TOLLWAY_HOME/worker.secret>)",
                             kind="authentication_error")
        return await handler(request)

    return middleware
