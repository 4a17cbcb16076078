"""Server-sent events framing of OpenAI streams: `data: <json>` events, ending with `data: [DONE]`."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
