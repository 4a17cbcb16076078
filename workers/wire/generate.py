"""The generate request and its result lines: the JSON both transports carry (`POST
/internal/generate` as NDJSON, the channel in frames), built by the gateway (`generate_body`),
parsed and validated by the worker (`parse_generate`), and the joined answer of a non-streamed
request (`LineJoiner`). No torch, no aiohttp.

The real worker server (`workers/server/app.py`) and its test double (`ops/fake_worker.py`) parse
with the same code, so both refuse the same bodies with the same messages and answer in the same
shape.

A result line is `{index, token_ids, text, finish_reason[, logprobs, top_logprobs]
[, prompt_logprobs, prompt_top_logprobs][, usage]}`: `index` is the choice (n > 1), `logprobs[i]`
the chosen token's log-probability for `token_ids[i]` and `top_logprobs[i]` its alternatives as
`[token_id, logprob]` pairs. With `sampling.prompt_logprobs` = k, the first line of choice 0 once
the prompt is computed (its first token's, or with `max_tokens` 0 its only line) also carries
`prompt_logprobs[i]`, the log-probability of prompt token i + 1 given the ones before it (the
first prompt token has none: the list is one shorter than the prompt), and `prompt_top_logprobs[i]`
the top k there as `[token_id, logprob]` pairs. The request's last line carries `usage`
({prompt_tokens, cached_tokens, completion_tokens}); a stopped request's last line has
finish_reason `abort`, a failed engine's `error`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, TypedDict

import orjson

from workers.wire.grammar import GrammarSpec, GrammarSpecError, parse_grammar
from workers.wire.sampling import SamplingParams

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"grammar"}  # grammar: its own field
TUPLE_FIELDS = {"stop", "stop_token_ids"}
PRIORITIES = ("interactive", "batch")
MAX_BODY_BYTES = 16 * 2**20
"""Largest generate body a worker accepts over HTTP (a channel frame has its own MAX_FRAME_BYTES)."""


class BadRequest(ValueError):
    """The caller's mistake: answered as a 400 with this message."""


Priority = Literal["interactive", "batch"]


class Usage(TypedDict):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Billing(TypedDict):
    """Who a request is billed to, as the gateway metered it. The worker keeps it, unread, with the
    request's usage until a gateway acknowledges the usage row (workers/server/ledger.py), so the
    row can still be written when the gateway that carried the request died."""

    tenant_id: int
    key_id: int | None
    model: str
    batch_id: str | None
    started_at: str  # ISO 8601, UTC
    route: NotRequired[str]  # chat.completions | completions | responses (the usage row's route)


class GenerateBody(TypedDict, total=False):
    """The JSON of one generate request (`sampling` holds SamplingParams' fields by name)."""

    request_id: str
    namespace: str  # the prefix-cache namespace: set by the gateway from the caller's key, never by clients
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    priority: Priority
    stream: bool
    billing: Billing  # absent for callers that bill nothing (tests, benches)
    grammar: dict[str, Any]  # GrammarSpec.to_json(): what the output must match (absent: free text)
    # the tenant's scheduling weight (> 0, default 1): the worker's fair scheduler divides the
    # namespace's service by it (workers/engine/fairness.py); set by the gateway, never by clients
    weight: float


def generate_body(request_id: str, namespace: str, prompt: list[int], sampling: dict[str, Any],
                  priority: Priority = "interactive", stream: bool = True,
                  billing: Billing | None = None, grammar: GrammarSpec | None = None,
                  weight: float = 1.0) -> GenerateBody:
    """The body the gateway sends (validated by the worker's `parse_generate`)."""
    body: GenerateBody = {"request_id": request_id, "namespace": namespace, "prompt_token_ids": prompt,
                          "sampling": sampling, "priority": priority, "stream": stream, "weight": weight}
    if billing is not None:
        body["billing"] = billing
    if grammar is not None:
        body["grammar"] = grammar.to_json()
    return body


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    namespace: str
    prompt: list[int]
    params: SamplingParams
    priority: str  # one of PRIORITIES
    stream: bool = True  # False: the answer comes at the end, one joined line per choice (LineJoiner)
    billing: dict[str, Any] | None = None  # opaque to the worker: kept with the usage (Billing)
    weight: float = 1.0  # the tenant's scheduling weight


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
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false")
    billing = body.get("billing")
    if billing is not None and not isinstance(billing, dict):
        raise BadRequest("billing must be an object")
    weight = body.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
        raise BadRequest("weight must be a number above 0")
    params = parse_sampling(body.get("sampling"), sampling_defaults)
    try:
        grammar = parse_grammar(body.get("grammar"))
    except GrammarSpecError as exc:
        raise BadRequest(str(exc)) from exc
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    return GenerateRequest(request_id, namespace, prompt, params, priority, stream, billing, float(weight))


def ndjson(lines: list[dict[str, Any]]) -> bytes:
    """Lines of a generate answer as NDJSON bytes, written together."""
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


class LineJoiner:
    """The answer to a non-streamed generate request (`"stream": false`): the delta lines of each
    choice joined into one line, written together once the request ends.

    A joined line has the delta fields (token_ids, text, logprobs, top_logprobs and the prompt's: concatenated;
    finish_reason: the choice's last) plus `decode_s`, the seconds between the choice's first and
    last token at the worker, so the caller can still tell time to first token and inter-token
    latency. The choice whose delta carried `usage` comes last and carries it, as in a stream.
    One write per request instead of one per token saves the caller a wakeup and a parse per token.
    """

    def __init__(self) -> None:
        self._lines: dict[int, dict[str, Any]] = {}
        self._first_token_at: dict[int, float] = {}

    def add(self, delta: dict[str, Any], now: float) -> None:
        index = delta["index"]
        joined = self._lines.get(index)
        if joined is None:
            joined = self._lines[index] = {"index": index, "token_ids": [], "text": "", "finish_reason": None,
                                           "decode_s": 0.0}
        if delta["token_ids"]:
            first = self._first_token_at.setdefault(index, now)
            joined["decode_s"] = now - first
            joined["token_ids"].extend(delta["token_ids"])
        joined["text"] += delta["text"]
        for name in ("logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs"):
            if name in delta:
                joined.setdefault(name, []).extend(delta[name])
        if delta["finish_reason"] is not None:
            joined["finish_reason"] = delta["finish_reason"]
        if "usage" in delta:
            joined["usage"] = delta["usage"]
            self._lines[index] = self._lines.pop(index)  # the usage line goes last

    def lines(self) -> list[dict[str, Any]]:
        return list(self._lines.values())
