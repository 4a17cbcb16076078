"""The worker's internal HTTP API for the gateway (aiohttp).

POST /internal/generate  JSON {request_id, namespace, prompt_token_ids, sampling, priority}
                         -> NDJSON deltas {index, token_ids, text, finish_reason[, logprobs]}
                         (index = choice, for n > 1); the request's last line adds usage
                         {prompt_tokens, cached_tokens, completion_tokens}.
                         A closed connection aborts the request.
POST /internal/requests/{id}/cancel  stop a request; its stream ends with an "abort" line that
                         still carries usage (so a client that went away is billed exactly)
GET  /internal/info      model, context length, block size, blocks, cache stats, queue lengths
GET  /internal/tokenizer the model's tokenizer files, so the gateway tokenizes without the model:
                         {model, tokenizer_json, tokenizer_config, chat_template}
GET  /healthz            liveness
GET  /metrics            Prometheus text format
Bad input answers 400 with {"error": {"message", "type"}}; never a 500 for a caller's mistake.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from workers.engine.async_engine import AsyncEngine
from workers.engine.request import Priority
from workers.models.tokenizer import tokenizer_payload
from workers.protocol import error, parse_generate

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
METRICS_KEY = web.AppKey("metrics", dict)


async def generate(request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json(loads=orjson.loads)
    except (orjson.JSONDecodeError, UnicodeDecodeError):
        return error(400, "the body is not valid JSON")
    try:
        parsed = parse_generate(body)
        stream = request.app[ENGINE_KEY].generate(parsed.request_id, parsed.prompt, parsed.params,
                                                  parsed.namespace, Priority[parsed.priority.upper()])
        first = await anext(stream)  # validation errors surface here, before any byte is sent
    except ValueError as exc:
        return error(400, str(exc))
    metrics = request.app[METRICS_KEY]
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    delta = first
    try:
        while True:
            line = {"index": delta.index, "token_ids": delta.token_ids, "text": delta.text,
                    "finish_reason": delta.finish_reason}
            if delta.logprobs is not None:
                line["logprobs"] = delta.logprobs
                line["top_logprobs"] = [[[t, lp] for t, lp in top] for top in delta.top_logprobs or []]
            if delta.usage is not None:
                line["usage"] = delta.usage
                metrics["prompt_tokens"].inc(delta.usage["prompt_tokens"])
                metrics["cached_tokens"].inc(delta.usage["cached_tokens"])
                metrics["completion_tokens"].inc(delta.usage["completion_tokens"])
            if delta.finish_reason is not None:
                metrics["finished"].labels(reason=delta.finish_reason).inc()
            await response.write(orjson.dumps(line) + b"\n")
            if delta.usage is not None:  # the request's last line: every choice has finished
                break
            delta = await anext(stream)
    except ConnectionResetError:  # the caller hung up: nothing more to send
        return response
    finally:
        await stream.aclose()  # on a closed connection this aborts the request
    await response.write_eof()
    return response


async def cancel(request: web.Request) -> web.Response:
    """Stop a request; its open stream ends with an 'abort' line carrying the usage so far."""
    request.app[ENGINE_KEY].cancel(request.match_info["request_id"])
    return web.json_response({"status": "cancelling"}, status=202)


async def info(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE_KEY].info(), dumps=lambda o: json.dumps(o, default=str))


async def tokenizer(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY].engine
    payload = {"model": engine.name, **tokenizer_payload(engine.loaded.folder)}
    # stdlib json: tokenizer configs hold integers beyond 64 bits (model_max_length = 1e30)
    return web.Response(text=json.dumps(payload), content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[ENGINE_KEY].info()
    gauges = request.app[METRICS_KEY]
    gauges["running"].set(state["running"])
    gauges["waiting"].set(state["waiting"])
    for kind, value in state["blocks"].items():
        gauges["blocks"].labels(state=kind).set(value)
    registry: CollectorRegistry = request.app[METRICS_KEY]["registry"]
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_metrics() -> dict[str, Any]:
    registry = CollectorRegistry()
    return {
        "registry": registry,
        "running": Gauge("tollway_worker_running_requests", "Requests running in the engine", registry=registry),
        "waiting": Gauge("tollway_worker_waiting_requests", "Requests waiting for admission", registry=registry),
        "blocks": Gauge("tollway_worker_kv_blocks", "KV blocks by state", ["state"], registry=registry),
        "prompt_tokens": Counter("tollway_worker_prompt_tokens", "Prompt tokens served", registry=registry),
        "cached_tokens": Counter("tollway_worker_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                 registry=registry),
        "completion_tokens": Counter("tollway_worker_completion_tokens", "Tokens generated", registry=registry),
        "finished": Counter("tollway_worker_choices_finished", "Finished choices by reason", ["reason"],
                            registry=registry),
    }


def create_worker_app(engine: AsyncEngine) -> web.Application:
    app = web.Application(client_max_size=16 * 2**20)
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = make_metrics()
    app.router.add_post("/internal/generate", generate)
    app.router.add_post("/internal/requests/{request_id}/cancel", cancel)
    app.router.add_get("/internal/info", info)
    app.router.add_get("/internal/tokenizer", tokenizer)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app
