"""Reading a JSON request body with the gateway's limits and errors."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from gateway.api.errors import ApiError, invalid
from gateway.state import SETTINGS


async def read_json(request: web.Request) -> Any:
    """The parsed body; over `client_max_size` → 413 (via aiohttp), not JSON → 400, not all
    received within `read_timeout_s` (a slow-loris client) → 408, and aiohttp closes the connection."""
    if request.content.is_eof():  # all of it is here already (a small body comes with its headers): no wait
        raw = await request.read()
    else:
        try:
            async with asyncio.timeout(request.app[SETTINGS].read_timeout_s):
                raw = await request.read()
        except TimeoutError as exc:
            raise ApiError(408, "the request body was not received in time", code="request_timeout") from exc
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from exc


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object ({} when there is none); anything else → 400."""
    body = await read_json(request) if request.can_read_body else {}
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def query_int(request: web.Request, name: str, default: int) -> int:
    """An integer query parameter (`default` when absent); a 400 naming it when it is not one."""
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise invalid(f"'{name}' must be an integer", name) from exc
