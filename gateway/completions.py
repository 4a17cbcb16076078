"""`POST /v1/chat/completions` and `POST /v1/completions`: auth → validate → tokenize → route → stream.

A request that has not streamed anything yet is retried on another worker when its worker is
unreachable or dies; once bytes have reached the client, a failure ends the stream with an
OpenAI error event instead (never a silent truncation, never a hang).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from aiohttp import web

from gateway.auth import bearer_token
from gateway.errors import ApiError, invalid
from gateway.openai_params import GenerationRequest, parse_request
from gateway.request_body import read_json
from gateway.responses import ResponseBuilder
from gateway.state import AUTH, POOL, ROUTER, SETTINGS
from gateway.tokenizer import ChatTemplateError
from gateway.worker_pool import ModelEntry, UpstreamBroken, UpstreamRejected, UpstreamUnavailable

DONE = b"data: [DONE]\n\n"


def model_entry(app: web.Application, name: str) -> ModelEntry:
    pool = app[POOL]
    entry = pool.models.get(name)
    if entry is not None:
        return entry
    if not pool.models:
        raise ApiError(503, "no engine worker is reachable yet; retry shortly", code="no_worker")
    raise ApiError(404, f"the model '{name}' does not exist; available: {', '.join(sorted(pool.models))}",
                   param="model", code="model_not_found")


def prompt_token_ids(entry: ModelEntry, params: GenerationRequest) -> list[int]:
    if params.messages is not None:
        try:
            return entry.tokenizer.encode_chat(params.messages)
        except ChatTemplateError as exc:
            raise invalid(str(exc), "messages") from exc
    if params.prompt_ids is not None:
        vocab = entry.tokenizer.vocab_size
        if any(t >= vocab for t in params.prompt_ids):
            raise invalid(f"token ids must be below the vocabulary size {vocab}", "prompt")
        return params.prompt_ids
    return entry.tokenizer.encode(params.prompt_text or "")


def completion_budget(entry: ModelEntry, params: GenerationRequest, num_prompt: int) -> int:
    """max_tokens for the worker; a prompt that does not fit the context is a 400 with the numbers."""
    where = "messages" if params.kind == "chat" else "prompt"
    wanted = params.max_tokens if params.max_tokens is not None else 1
    if num_prompt + wanted > entry.context_length:
        raise invalid(
            f"This model's maximum context length is {entry.context_length} tokens. However, you requested "
            f"{num_prompt + wanted} tokens ({num_prompt} in the {where}, {wanted} in the completion). "
            f"Please reduce the length of the {where} or the completion.",
            where, code="context_length_exceeded")
    return params.max_tokens if params.max_tokens is not None else entry.context_length - num_prompt


async def open_stream(
    app: web.Application, model: str, namespace: str, prompt: list[int], body: dict[str, Any]
) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]]]:
    """The first line and the rest of a worker stream, trying other workers until one starts."""
    pool, router = app[POOL], app[ROUTER]
    tried: set[str] = set()
    for _ in range(app[SETTINGS].max_attempts):
        loads = pool.loads(model, exclude=tried)
        if not loads:
            break
        url = router.choose(namespace, prompt, loads)
        lines = pool.stream(url, body)
        try:
            return await anext(lines), lines
        except UpstreamUnavailable:
            tried.add(url)
            router.forget_worker(url)
        except UpstreamRejected as exc:
            raise ApiError(exc.status if exc.status != 404 else 400, exc.message) from exc
        except StopAsyncIteration:
            tried.add(url)
    raise ApiError(503, f"no engine worker for '{model}' could take the request; retry shortly",
                   code="no_worker", headers={"Retry-After": "1"})


def worker_body(request_id: str, namespace: str, prompt: list[int], params: GenerationRequest,
                max_tokens: int) -> dict[str, Any]:
    sampling = {**params.sampling, "max_tokens": max_tokens}
    if params.logprobs is not None:
        sampling["logprobs"] = params.logprobs
    return {"request_id": request_id, "namespace": namespace, "prompt_token_ids": prompt,
            "sampling": sampling, "priority": "interactive"}


async def handle(request: web.Request, kind: Literal["chat", "completion"]) -> web.StreamResponse:
    app = request.app
    record = await app[AUTH].authenticate(bearer_token(request))
    params = parse_request(kind, await read_json(request))
    entry = model_entry(app, params.model)
    prompt = prompt_token_ids(entry, params)
    max_tokens = completion_budget(entry, params, len(prompt))
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    namespace = f"tenant-{record.tenant_id}"  # set here, from the key: clients never choose it
    body = worker_body(request_id, namespace, prompt, params, max_tokens)
    builder = ResponseBuilder(kind, request_id, entry.name, int(time.time()), entry.tokenizer,
                              params.logprobs is not None)
    if params.stream:
        first, lines = await open_stream(app, entry.name, namespace, prompt, body)
        return await stream_events(request, builder, params, first, lines)
    # Nothing reaches the client before the end, so a worker lost midway costs a retry, not an error.
    for _ in range(app[SETTINGS].max_attempts):
        first, lines = await open_stream(app, entry.name, namespace, prompt, body)
        try:
            return await collect(builder, first, lines)
        except UpstreamBroken:
            builder.choices.clear()
    raise ApiError(502, "engine workers failed mid-request on every attempt; retry later", code="worker_failed")


def _failed(delta: dict[str, Any]) -> bool:
    return delta.get("finish_reason") in ("error", "abort")


async def collect(builder: ResponseBuilder, first: dict[str, Any],
                  lines: AsyncIterator[dict[str, Any]]) -> web.Response:
    """The whole answer as one JSON object; raises UpstreamBroken if the worker stream breaks."""
    delta: dict[str, Any] | None = first
    try:
        while delta is not None:
            if _failed(delta):
                raise ApiError(502, "the engine failed while generating; retry the request", code="engine_error")
            builder.absorb(delta)
            if "usage" in delta:
                return web.Response(body=orjson.dumps(builder.final(delta["usage"])), content_type="application/json")
            delta = await anext(lines, None)
    finally:
        await lines.aclose()
    raise UpstreamBroken("the engine worker ended the request without a result")


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def stream_events(request: web.Request, builder: ResponseBuilder, params: GenerationRequest,
                        first: dict[str, Any], lines: AsyncIterator[dict[str, Any]]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    opened: set[int] = set()
    delta: dict[str, Any] | None = first
    try:
        while delta is not None:
            if _failed(delta):
                raise UpstreamBroken("the engine failed while generating")
            if builder.kind == "chat" and delta["index"] not in opened:
                opened.add(delta["index"])
                await response.write(sse(builder.role_chunk(delta["index"])))
            await response.write(sse(builder.chunk(delta)))
            if "usage" in delta:
                if params.include_usage:
                    await response.write(sse(builder.usage_chunk(delta["usage"])))
                await response.write(DONE)
                break
            delta = await anext(lines, None)
        else:
            raise UpstreamBroken("the engine worker ended the stream early")
    except UpstreamBroken as exc:
        error = ApiError(502, f"the engine worker failed mid-stream: {exc}", code="worker_failed")
        await response.write(sse(error.body()))
    except ConnectionResetError:  # the client hung up: closing `lines` aborts the request upstream
        return response
    finally:
        await lines.aclose()
    await response.write_eof()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """Create a chat completion (OpenAI-compatible; SSE when `stream` is true)."""
    return await handle(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    """Create a text completion (OpenAI-compatible; SSE when `stream` is true)."""
    return await handle(request, "completion")


async def list_models(request: web.Request) -> web.Response:
    """List the models served by the workers in rotation."""
    await request.app[AUTH].authenticate(bearer_token(request))
    data = [model_object(name) for name in sorted(request.app[POOL].models)]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    """One model."""
    await request.app[AUTH].authenticate(bearer_token(request))
    return web.json_response(model_object(model_entry(request.app, request.match_info["model"]).name))


def model_object(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tollway"}
