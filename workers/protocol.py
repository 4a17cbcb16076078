"""The worker's internal generate request as JSON: parsing and validation (no torch).

Shared by the real worker server (`workers/server.py`) and its test double (`ops/fake_worker.py`),
so both refuse the same bodies with the same messages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from workers.engine.params import SamplingParams

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
TUPLE_FIELDS = {"stop", "stop_token_ids"}
PRIORITIES = ("interactive", "batch")


class BadRequest(ValueError):
    """The caller's mistake: answered as a 400 with this message."""


def error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    namespace: str
    prompt: list[int]
    params: SamplingParams
    priority: str  # one of PRIORITIES


def parse_sampling(raw: Any, defaults: dict[str, Any] | None = None) -> SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling must be an object")
    unknown = set(raw) - SAMPLING_FIELDS
    if unknown:
        raise BadRequest(f"unknown sampling fields: {', '.join(sorted(unknown))}")
    values = {**(defaults or {}), **raw}
    for name in TUPLE_FIELDS & set(values):
        if isinstance(values[name], str):
            values[name] = [values[name]]
        if not isinstance(values[name], list | tuple):
            raise BadRequest(f"sampling.{name} must be a list")
        values[name] = tuple(values[name])
    for name, value in values.items():
        if name not in TUPLE_FIELDS and value is not None and not isinstance(value, int | float):
            raise BadRequest(f"sampling.{name} must be a number")
    try:
        return SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from exc


def parse_generate(body: Any, sampling_defaults: dict[str, Any] | None = None) -> GenerateRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    request_id, namespace = body.get("request_id"), body.get("namespace", "default")
    if not isinstance(request_id, str) or not request_id:
        raise BadRequest("request_id must be a non-empty string")
    if not isinstance(namespace, str) or not namespace:
        raise BadRequest("namespace must be a non-empty string")
    prompt = body.get("prompt_token_ids")
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise BadRequest("prompt_token_ids must be a list of integers")
    priority = str(body.get("priority", "interactive")).lower()
    if priority not in PRIORITIES:
        raise BadRequest("priority must be 'interactive' or 'batch'")
    params = parse_sampling(body.get("sampling"), sampling_defaults)
    return GenerateRequest(request_id, namespace, prompt, params, priority)
