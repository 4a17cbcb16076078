"""Reading a JSON request body with the gateway's limits and errors."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from gateway.errors import invalid


async def read_json(request: web.Request) -> Any:
    """The parsed body; over `client_max_size` → 413 (via aiohttp), not JSON → 400."""
    raw = await request.read()
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
