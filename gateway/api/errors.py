"""OpenAI-style error objects and the middleware that turns every failure into one.

Every error leaves the gateway as `{"error": {"message", "type", "param", "code"}}` with a 4xx for
the caller's mistakes and a 5xx only for ours (or an upstream's). Views raise `ApiError`; aiohttp's
own HTTP exceptions (unknown route, wrong method, oversized body) are mapped here too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

log = logging.getLogger("tollway.gateway")

# The OpenAI `type` for each status the gateway answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        type: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(body=orjson.dumps(self.body()), status=self.status,
                            content_type="application/json", headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 `invalid_request_error` that names the offending parameter."""
    return ApiError(400, message, param=param, code=code)


def _from_http_exception(exc: web.HTTPException) -> ApiError:
    if exc.status == 413:
        return ApiError(413, f"request body too large: {exc.text}", code="request_too_large")
    if exc.status == 404:
        return ApiError(404, "no such route", code="unknown_url")
    return ApiError(exc.status, exc.reason or "request failed")


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(exc).response()
    except Exception:  # a bug of ours: logged with its traceback, answered without internals
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal error; the request was not processed", code="internal_error").response()
