"""A TEST DOUBLE of an engine worker, for gateway tests and benchmarks. It runs no model.

It serves the same internal HTTP API as the real worker (`workers/server/app.py`), with the same
request validation, 400 shape, NDJSON stream shape and `/internal/info` keys, but streams canned
tokens at once (or every `delay_s`): token i of each choice has id i and text " tok{i}", the last
one finishes with "length", and the request's last line adds usage (with `"stream": false`, one joined
line per choice at the end, as the real worker; `max_tokens` 0: one line, no token). Sampling fields
other than `max_tokens`, `n`, `logprobs` and `prompt_logprobs` (-0.25 for every prompt token) are
validated and then ignored. Hooks for gateway tests: every
received JSON body is recorded in `requests` (its trace headers in `trace_headers`; as a process,
`--record-bodies` keeps them too, else only their count);
`fail_after_tokens` drops the connection after that many lines (a worker dying mid-stream: on the
generate channel, every request on it fails); `healthy = False` makes `/healthz` answer 503.
Its door is the real worker's (workers/server/auth.py): every /internal/* call needs `secret` as its
bearer (`FAKE_WORKER_SECRET` unless set; as a process, TOLLWAY_WORKER_SECRET or
`$TOLLWAY_HOME/worker.secret`, as `tollway worker`), so gateway tests exercise the credential.

`GET /internal/tokenizer` serves a tiny character-level tokenizer (printable ASCII, newline and
tab, plus ChatML special tokens) with a ChatML chat template, in the real route's shape.

    python -m ops.fake_worker --port 8101     # one fake worker, e.g. behind a gateway benchmark
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ops.startup_heap import frozen_startup_heap
from workers.server.auth import internal_auth
from workers.server.billing import BILLING_KEY, setup_billing
from workers.server.channel import serve_channel, setup_channels
from workers.server.errors import error
from workers.server.ledger import UsageLedger
from workers.server.metrics import WorkerMetrics, make_metrics
from workers.settings import WorkerSettings
from workers.wire import generate as protocol  # the real worker's request parsing: no torch, no model
from workers.wire.files import load_or_create_worker_secret
from workers.wire.sampling import SamplingParams

FAKE_WORKER_SECRET = "tw-worker-fake-secret"
"""The test double's credential unless given another (tests give the gateway the same)."""
SPECIAL_TOKENS = ("<unk>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class FakeWorker:
    """State and knobs of one fake worker; tests may change the knobs while it serves."""

    model: str = "smollm2-135m-instruct"
    context_length: int = 8192
    delay_s: float = 0.0  # sleep before each streamed line
    fail_after_tokens: int | None = None  # drop the connection after this many lines
    healthy: bool = True  # False: /healthz answers 503 (generation still works)
    secret: str = FAKE_WORKER_SECRET  # the bearer every /internal/* call must carry
    # (namespace, prompt_token_ids) -> the cached_tokens to report; None reports 0.
    cached_tokens: Callable[[str, list[int]], int] | None = None
    vocab_size: int = 49_152  # prompt token ids must be in [0, vocab_size), as on the real worker
    block_size: int = 8
    num_blocks: int = 1024
    record_bodies: bool = True  # False: count the bodies only (a benchmark's long run would hoard them)
    received: int = 0  # generate bodies received
    requests: list[Any] = field(default_factory=list)  # every JSON body received, in order (if recorded)
    trace_headers: list[dict[str, str]] = field(default_factory=list)  # their traceparent/tracestate, if any
    running: set[str] = field(default_factory=set)  # request ids streaming now
    cancelled: set[str] = field(default_factory=set)  # running ids asked to stop (cancel route)
    max_running: int = 0  # the most requests ever streaming at once (concurrency limits are checked here)
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> choices
    cache: dict[str, dict[str, int]] = field(default_factory=dict)  # namespace -> stats, as the real info
    totals: dict[str, int] = field(default_factory=lambda: {"prompt": 0, "cached": 0, "completion": 0})

    def cancel(self, request_id: str) -> None:
        """The `cancel` verb (HTTP route or channel frame): a running request ends with an abort line."""
        if request_id in self.running:
            self.cancelled.add(request_id)

    def info(self) -> dict[str, Any]:
        """The real worker's `/internal/info` keys, with plausible idle values."""
        return {
            "model": self.model, "dtype": "fake", "quantization": "none", "quantized_activations": None, "kv_cache_dtype": "fake", "context_length": self.context_length,
            "block_size": self.block_size,
            "blocks": {"total": self.num_blocks, "free": self.num_blocks, "used": 0, "evictable": 0},
            "kv_utilization": None, "cache": {ns: dict(s) for ns, s in self.cache.items()},
            "finished": dict(self.finished), "running": len(self.running), "waiting": 0, "preemptions": 0,
            "scheduling": "fair", "tenants": {ns: {"counter": 0.0, "weight": 1.0, "input_tokens": 0, "output_tokens": 0,
                                                   "waiting": 0, "running": 0} for ns in self.cache},
            "speculative": {"mode": "off", "drafted_tokens": 0, "accepted_tokens": 0, "verifications": 0,
                            "acceptance_rate": 0.0, "mean_accepted_length": 0.0},
            "fake": {"max_running": self.max_running, "requests": self.received},  # the double's own
        }


FAKE_WORKER_KEY = web.AppKey("fake_worker", FakeWorker)
METRICS_KEY = web.AppKey("fake_metrics", WorkerMetrics)  # the real worker's metric names and kinds


def parse_generate(worker: FakeWorker, body: Any) -> protocol.GenerateRequest:
    parsed = protocol.parse_generate(body, sampling_defaults={"max_tokens": 16})  # the real engine's is 256
    request_id, prompt = parsed.request_id, parsed.prompt
    # The engine's checks (Engine.validate_request), in its order.
    if not prompt:
        raise protocol.BadRequest("the prompt has no tokens")
    if any(not 0 <= t < worker.vocab_size for t in prompt):
        raise protocol.BadRequest(f"prompt token ids must be in [0, {worker.vocab_size})")
    if len(prompt) > worker.context_length - (parsed.params.max_tokens > 0):
        raise protocol.BadRequest(f"the prompt has {len(prompt)} tokens; the context holds {worker.context_length}")
    if request_id in worker.running:
        raise protocol.BadRequest(f"request id {request_id!r} is already running")
    return parsed


def _lines(worker: FakeWorker, namespace: str, prompt: list[int], params: SamplingParams) -> list[dict[str, Any]]:
    """Every line of one request's stream, choices interleaved step by step as the engine does."""
    steps = min(params.max_tokens, worker.context_length - len(prompt))
    lines: list[dict[str, Any]] = [] if steps else [{"index": 0, "token_ids": [], "text": "", "finish_reason": "length"}]
    for i in range(steps):
        for index in range(params.n):
            line: dict[str, Any] = {"index": index, "token_ids": [i], "text": f" tok{i}",
                                    "finish_reason": "length" if i == steps - 1 else None}
            if params.logprobs is not None:  # the chosen token's logprob, then the top k as [id, logprob]
                line["logprobs"] = [-0.5]
                line["top_logprobs"] = [[[i + j, -0.5 - j] for j in range(params.logprobs)]]
            lines.append(line)
    if params.prompt_logprobs is not None:  # on choice 0's first line: -0.25 each, the top k as [id, logprob]
        lines[0]["prompt_logprobs"] = [-0.25] * (len(prompt) - 1)
        lines[0]["prompt_top_logprobs"] = [[[(t + j) % worker.vocab_size, -0.25 - j] for j in range(params.prompt_logprobs)]
                                           for t in prompt[1:]]
    cached = worker.cached_tokens(namespace, prompt) if worker.cached_tokens else 0
    lines[-1]["usage"] = {"prompt_tokens": len(prompt), "cached_tokens": cached,
                          "completion_tokens": steps * params.n}
    return lines


def _account(worker: FakeWorker, namespace: str, usage: dict[str, int], choices: int) -> None:
    stats = worker.cache.setdefault(
        namespace, {"hit_tokens": 0, "miss_tokens": 0, "inserted_tokens": 0, "evicted_tokens": 0})
    miss = usage["prompt_tokens"] - usage["cached_tokens"]
    stats["hit_tokens"] += usage["cached_tokens"]
    stats["miss_tokens"] += miss
    stats["inserted_tokens"] += miss
    worker.finished["length"] = worker.finished.get("length", 0) + choices
    worker.totals["prompt"] += usage["prompt_tokens"]
    worker.totals["cached"] += usage["cached_tokens"]
    worker.totals["completion"] += usage["completion_tokens"]


def _answer(request: web.Request, body: Any, headers: Mapping[str, str],
            owner: object | None = None) -> AsyncGenerator[list[dict[str, Any]]]:
    """The answer to one generate body in batches of lines (as the real worker's `answer`); raises
    BadRequest at once for a bad body."""
    worker = request.app[FAKE_WORKER_KEY]
    worker.received += 1
    if worker.record_bodies:
        worker.requests.append(body)
        worker.trace_headers.append({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
    parsed = parse_generate(worker, body)
    request.app[BILLING_KEY].started(parsed.request_id, parsed.billing, owner)
    lines = _lines(worker, parsed.namespace, parsed.prompt, parsed.params)
    return _emit(request, worker, parsed.request_id, parsed.namespace, lines, parsed.params.n, parsed.stream,
                 channel=owner is not None)


async def _emit(request: web.Request, worker: FakeWorker, request_id: str, namespace: str,
                lines: list[dict[str, Any]], choices: int, stream: bool,
                channel: bool = False) -> AsyncGenerator[list[dict[str, Any]]]:
    joiner = None if stream else protocol.LineJoiner()  # as the real worker: all at the end
    worker.running.add(request_id)
    worker.max_running = max(worker.max_running, len(worker.running))
    handed_out = 0  # lines given to the caller (a line is a token)
    final: tuple[dict[str, int], str] | None = None  # the usage line's (usage, finish_reason)
    died = False
    try:
        for sent, line in enumerate(lines):
            if request_id in worker.cancelled:  # as the engine: an "abort" line with the usage so far
                usage = {**lines[-1]["usage"], "completion_tokens": sent}
                line = {"index": 0, "token_ids": [], "text": "", "finish_reason": "abort", "usage": usage}
            elif sent == worker.fail_after_tokens:
                if request.transport is not None:  # the worker "dies": no more bytes (on a channel: for all)
                    if channel:  # once the lines handed out leave: the channel's outbox writes them next turn
                        asyncio.get_running_loop().call_soon(request.transport.abort)
                    else:
                        request.transport.abort()
                died = True  # and keeps no usage
                return
            elif worker.delay_s > 0:
                await asyncio.sleep(worker.delay_s)
            if "usage" in line:
                final = (line["usage"], line["finish_reason"])
            handed_out = sent + 1
            if joiner is None:
                yield [line]
            else:
                joiner.add(line, time.perf_counter())
            if "usage" in line:
                break
        if line is lines[-1]:  # ran to the end (not cancelled)
            _account(worker, namespace, lines[-1]["usage"], choices)
            metrics, usage = request.app[METRICS_KEY], lines[-1]["usage"]
            metrics.prompt_tokens.inc(usage["prompt_tokens"])
            metrics.cached_tokens.inc(usage["cached_tokens"])
            metrics.completion_tokens.inc(usage["completion_tokens"])
            metrics.finished.labels(reason="length").inc(choices)
        if joiner is not None:
            yield joiner.lines()
    finally:
        worker.running.discard(request_id)
        worker.cancelled.discard(request_id)
        billing = request.app[BILLING_KEY]
        if died:
            billing.refused(request_id)
        elif final is not None:  # ran to the end, or cancelled: as the engine reports it
            billing.finished(request_id, *final)
        else:  # abandoned by its caller (a closed connection or channel)
            billing.finished(request_id, {**lines[-1]["usage"], "completion_tokens": handed_out}, "abort")


async def generate(request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json(loads=orjson.loads)
    except (orjson.JSONDecodeError, UnicodeDecodeError):
        return error(400, "the body is not valid JSON")
    try:
        lines = _answer(request, body, request.headers)
    except protocol.BadRequest as exc:
        return error(400, str(exc))
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    try:
        await response.prepare(request)
        async for batch in lines:
            await response.write(protocol.ndjson(batch))
        if request.transport is not None and not request.transport.is_closing():
            await response.write_eof()
    except ConnectionResetError:  # the caller hung up: nothing more to send
        pass
    finally:
        await lines.aclose()
    return response


async def channel(request: web.Request) -> web.WebSocketResponse:
    """The generate channel (workers/server/channel.py), answered as `generate` answers."""
    app = request.app
    return await serve_channel(request, lambda body, headers, owner: _answer(request, body, headers, owner),
                               app[FAKE_WORKER_KEY].cancel, app[BILLING_KEY])


async def cancel(request: web.Request) -> web.Response:
    request.app[FAKE_WORKER_KEY].cancel(request.match_info["request_id"])
    return web.json_response({"status": "cancelling"}, status=202)


async def info(request: web.Request) -> web.Response:
    return web.json_response({**request.app[FAKE_WORKER_KEY].info(), "usage_ledger": request.app[BILLING_KEY].info()})


@functools.cache
def fake_tokenizer_files() -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config) of the tiny tokenizer; built on first use."""
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    # BPE with no merges and no pre-tokenizer = one token per character; others become <unk>.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()  # join characters back without spaces
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<unk>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return tokenizer.to_str(), config


async def tokenizer(request: web.Request) -> web.Response:
    tokenizer_json, config = fake_tokenizer_files()
    payload = {"model": request.app[FAKE_WORKER_KEY].model, "tokenizer_json": tokenizer_json,
               "tokenizer_config": dict(config), "chat_template": CHAT_TEMPLATE}
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    if not request.app[FAKE_WORKER_KEY].healthy:
        return web.json_response({"status": "unhealthy"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[METRICS_KEY].registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_fake_worker_app(worker: FakeWorker | None = None, **options: Any) -> web.Application:
    """The fake worker's app; pass a `FakeWorker` to keep a handle on it, or its fields as options.

    The state is also at `app[FAKE_WORKER_KEY]`.
    """
    if worker is not None and options:
        raise TypeError("pass either a FakeWorker or its options, not both")
    state = worker if worker is not None else FakeWorker(**options)
    app = web.Application(client_max_size=16 * 2**20, middlewares=[internal_auth(lambda: state.secret)])
    app[FAKE_WORKER_KEY] = state
    app[METRICS_KEY] = make_metrics(state.info)
    setup_billing(app, UsageLedger())
    app.router.add_post("/internal/generate", generate)
    app.router.add_get("/internal/channel", channel)
    setup_channels(app)
    app.router.add_post("/internal/requests/{request_id}/cancel", cancel)
    app.router.add_get("/internal/info", info)
    app.router.add_get("/internal/tokenizer", tokenizer)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A fake engine worker (test double: canned tokens, no model).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument("--delay-s", type=float, default=0.0, help="seconds before each streamed token")
    parser.add_argument("--record-bodies", action="store_true",
                        help="keep every request body in memory (the in-process test hook); off: count them only")
    args = parser.parse_args(argv)
    settings = WorkerSettings()  # the real worker's rule for its secret
    secret, _ = load_or_create_worker_secret(settings.worker_secret, settings.home)
    app = create_fake_worker_app(model=args.model, context_length=args.context_length, delay_s=args.delay_s,
                                 record_bodies=args.record_bodies, secret=secret)
    app.cleanup_ctx.append(frozen_startup_heap)
    print(f"fake worker (test double, no model) as {args.model!r} on http://{args.host}:{args.port}", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
