"""`GET /openapi.json`: an OpenAPI 3.1 description generated from the app's own route table.

Every registered route appears (a test checks it), with the summary taken from its handler's
docstring, so the document cannot drift from the code. Request bodies of the OpenAI routes follow
OpenAI's published schemas; only the fields tollway reads are listed here.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

_MESSAGE = {"type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                           "content": {"oneOf": [{"type": "string"}, {"type": "array"}]}}}
_SAMPLING = {
    "model": {"type": "string"}, "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "n": {"type": "integer", "minimum": 1},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "presence_penalty": {"type": "number"}, "frequency_penalty": {"type": "number"}, "seed": {"type": "integer"},
    "stream": {"type": "boolean"}, "stream_options": {"type": "object"},
    "top_k": {"type": "integer", "description": "tollway extra; -1 = off"},
    "min_p": {"type": "number", "description": "tollway extra"},
    "repetition_penalty": {"type": "number", "description": "tollway extra"},
    "ignore_eos": {"type": "boolean", "description": "tollway extra"},
}
SCHEMAS: dict[str, Any] = {
    "ChatCompletionRequest": {"type": "object", "required": ["model", "messages"], "properties": {
        **_SAMPLING, "messages": {"type": "array", "items": _MESSAGE}, "max_completion_tokens": {"type": "integer"},
        "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}},
    "CompletionRequest": {"type": "object", "required": ["model", "prompt"], "properties": {
        **_SAMPLING, "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "echo": {"type": "boolean", "description": "the prompt (and with logprobs its tokens' logprobs) first"},
        "max_tokens": {"type": "integer", "minimum": 0, "description": "0 only with echo: the prompt alone"}}},
    "ResponseCreateRequest": {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string"}, "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"type": "string"}, "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number"}, "top_p": {"type": "number"}, "stream": {"type": "boolean"},
        "text": {"type": "object"}, "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]}, "store": {"type": "boolean"}}},
    "BatchCreateRequest": {"type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
                           "properties": {"input_file_id": {"type": "string"},
                                          "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions", "/v1/responses"]},
                                          "completion_window": {"enum": ["24h"]},
                                          "metadata": {"type": ["object", "null"],
                                                       "additionalProperties": {"type": "string"}}}},
    "Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}},
}
BROWSER_PAGES = ("/admin/dashboard",)
REQUEST_BODIES = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/responses": "ResponseCreateRequest",
    "/v1/batches": "BatchCreateRequest",
}


def _operation(path: str, method: str, handler: Any) -> dict[str, Any]:
    doc = (handler.__doc__ or "").strip().splitlines()
    operation: dict[str, Any] = {
        "summary": doc[0] if doc else f"{method} {path}",
        "responses": {"200": {"description": "OK"},
                      "default": {"description": "OpenAI-style error",
                                  "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}},
    }
    if path == "/readyz":
        operation["responses"]["503"] = {"description": "not ready: no engine worker is in rotation (or none of a "
                                                        "model named by `model`; the body lists it in "
                                                        "`models_missing`)"}
        operation["parameters"] = [{"name": "model", "in": "query", "required": False,
                                    "description": "also wait for a worker of this model (repeatable; an empty "
                                                   "name is a 400)",
                                    "schema": {"type": "string"}}]
    if path.startswith(("/v1/", "/admin/")):
        operation["security"] = [{"bearer": []}]
    if method == "POST" and path in REQUEST_BODIES:
        ref = {"$ref": f"#/components/schemas/{REQUEST_BODIES[path]}"}
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    parameters = [{"name": part[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
                  for part in path.split("/") if part.startswith("{")]
    if parameters:
        operation["parameters"] = parameters
    return operation


def build_openapi(app: web.Application) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        if route.method in ("HEAD", "OPTIONS") or route.resource is None:
            continue
        path = route.resource.canonical
        if path.startswith(BROWSER_PAGES):  # HTML for people, not part of the JSON API
            continue
        paths.setdefault(path, {})[route.method.lower()] = _operation(path, route.method, route.handler)
    return {
        "openapi": "3.1.0",
        "info": {"title": "tollway gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible API under /v1, admin API under /admin/v1."},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
