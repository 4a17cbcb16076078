"""The relay floor: the least a gateway in front of tollway's workers can cost, to measure the gateway against.

An aiohttp server (the gateway's framework, on the gateway's event loop: uvloop where installed) whose one route, `POST
/v1/chat/completions`, reads and parses the JSON body, sends a generate request over tollway's own worker
channel (gateway/upstream/channel.py: one websocket to the worker, frames batched per loop turn), collects the
worker's lines and answers an OpenAI-shaped JSON body. Nothing else: no API key, quota, tokenizer (the prompt is
fixed token ids), usage row, metric or trace. `ops.bench.gateway_overhead --floor` runs it beside the gateway,
on the same fake worker and the same load: the CPU a request costs here is the transport's share of the
gateway's, and the difference is what tollway's own request path (auth, validation, tokenization, quotas,
metering, telemetry) costs.

A bench double, not a product: it answers only the bench's request shape.

    .venv/bin/python -m ops.bench.relay_floor --port PORT --worker-url URL   (TOLLWAY_WORKER_SECRET in the env)
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import aiohttp
import orjson
from aiohttp import web

from gateway.app import new_event_loop
from gateway.upstream.channel import WorkerChannel
from ops.bench.gateway_overhead import DIRECT_PROMPT_IDS as PROMPT_IDS  # as the bench's direct requests send
from ops.startup_heap import frozen_startup_heap, rarer_young_collections
from workers.wire.generate import Billing, generate_body

CHANNEL_KEY = web.AppKey("channel", WorkerChannel)
REQUEST_NUMBERS = itertools.count()  # request ids unique in this process
CONNECT_TIMEOUT_S = 5.0


async def relay(request: web.Request) -> web.Response:
    """The chat request's `max_tokens` tokens from the worker, joined into one chat completion."""
    raw = orjson.loads(await request.read())
    request_id = f"floor-{next(REQUEST_NUMBERS)}"
    # With `billing`, as the gateway sends it: the worker keeps the usage until the acknowledgement below.
    billing: Billing = {"tenant_id": 0, "key_id": None, "model": raw.get("model"), "batch_id": None,
                        "started_at": datetime.now(UTC).isoformat(), "route": "chat.completions"}
    body = generate_body(request_id, "floor", PROMPT_IDS, {"max_tokens": int(raw["max_tokens"]), "ignore_eos": True},
                         stream=False, billing=billing)
    channel = request.app[CHANNEL_KEY]
    answer = await channel.open_request(body, {})
    texts: list[str] = []
    usage: dict[str, int] = {}
    try:
        while (lines := await answer.next_lines()) is not None:
            for line in lines:
                texts.append(line.get("text", ""))
                usage = line.get("usage", usage)
    finally:
        await channel.release(answer)
    channel.acknowledge(request_id)  # as the gateway, once billed: the worker may forget the request's usage
    completion = {"id": request_id, "object": "chat.completion", "model": raw.get("model"),
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(texts)},
                               "finish_reason": "length"}],
                  "usage": {"prompt_tokens": usage.get("prompt_tokens", 0),
                            "completion_tokens": usage.get("completion_tokens", 0),
                            "total_tokens": usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)}}
    return web.Response(body=orjson.dumps(completion), content_type="application/json")


async def healthz(_request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def create_relay_app(worker_url: str, worker_secret: str) -> web.Application:
    app = web.Application()

    async def channel_context(app: web.Application) -> AsyncIterator[None]:
        async with aiohttp.ClientSession() as session:
            channel = WorkerChannel(worker_url, session, CONNECT_TIMEOUT_S,
                                    {"Authorization": f"Bearer {worker_secret}"})
            app[CHANNEL_KEY] = channel
            yield
            await channel.close()

    app.cleanup_ctx.append(channel_context)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/healthz", healthz)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker-url", required=True)
    args = parser.parse_args(argv)
    app = create_relay_app(args.worker_url, os.environ["TOLLWAY_WORKER_SECRET"])
    app.cleanup_ctx.extend([frozen_startup_heap, rarer_young_collections])  # the gateway's garbage collection
    web.run_app(app, host=args.host, port=args.port, print=None, loop=new_event_loop(), access_log=None)


if __name__ == "__main__":
    main()
