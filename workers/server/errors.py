"""The worker's HTTP error answers: `{"error": {"message", "type"}}` with a 4xx for the caller's mistakes."""

from __future__ import annotations

from aiohttp import web


def error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)
