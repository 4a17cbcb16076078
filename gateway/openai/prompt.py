"""The parse stage of a generation request: what the engine is asked to do.

From a validated OpenAI body (gateway/openai/params.py) to the served model, the prompt's token ids
(the model's chat template for chat), the completion budget that fits the context, and the
generate body a worker receives (workers/wire/generate.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from aiohttp import web

from gateway.api.body import read_json
from gateway.api.errors import invalid
from gateway.auth.guards import Caller
from gateway.observability.tracing import TRACING
from gateway.openai.models import model_entry
from gateway.openai.params import GenerationKind, GenerationRequest, parse_request
from gateway.openai.tools import default_rendering
from gateway.upstream.pool import ModelEntry
from workers.wire.generate import Billing, GenerateBody, generate_body
from workers.wire.tokenizer import ChatTemplateError


@dataclass(frozen=True)
class ParsedGeneration:
    """One generation request after parsing: everything the later stages need."""

    request_id: str
    raw: Any  # the JSON body as received (the idempotency hash, traced prompts)
    params: GenerationRequest
    entry: ModelEntry
    prompt: list[int]
    max_tokens: int  # the completion budget each choice gets

    @property
    def reserved_tokens(self) -> int:
        """What quota admission reserves: the prompt plus every choice's whole budget."""
        return len(self.prompt) + self.max_tokens * self.params.n


async def parse_generation(request: web.Request, kind: GenerationKind, caller: Caller,
                           parse: Callable[[Any], GenerationRequest] | None = None) -> ParsedGeneration:
    """Read and validate the body (with `parse`, another API's body read as a chat request), look up
    the model, tokenize; a 4xx naming the problem otherwise."""
    raw = await read_json(request)
    params = parse(raw) if parse is not None else parse_request(kind, raw)
    if caller.batch_id is not None and params.stream:
        raise invalid("batch requests cannot be streamed: remove 'stream'", "stream")
    entry = model_entry(request.app, params.model)
    with request.app[TRACING].span("gateway.tokenize") as span:
        prompt = prompt_token_ids(entry, params, namespace_of(caller))
        max_tokens = completion_budget(entry, params, len(prompt))
        if span is not None:
            span.set_attribute("tollway.request.prompt_tokens", len(prompt))
    prefix = "resp_" if parse is not None else "chatcmpl-" if kind == "chat" else "cmpl-"
    request_id = f"{prefix}{os.urandom(16).hex()}"  # 32 random hex digits (uuid4().hex: 122 random bits, 5x the time)
    return ParsedGeneration(request_id, raw, params, entry, prompt, max_tokens)


def prompt_token_ids(entry: ModelEntry, params: GenerationRequest, namespace: str) -> list[int]:
    """The prompt's token ids; a chat's repeated pieces come from the tokenizer's cache for `namespace`
    (the caller's tenant: one tenant never times another's cached text)."""
    if params.messages is not None:
        tokenizer, tools = entry.tokenizer, params.tools
        try:
            if tokenizer.renders_tools:  # the model's own tool format
                definitions = [t.definition() for t in tools.tools] if tools is not None and tools.active else None
                return tokenizer.encode_chat(params.messages, tools=definitions, cache_scope=namespace)
            if tools is not None or any("tool_calls" in m or m["role"] == "tool" for m in params.messages):
                return tokenizer.encode_chat(default_rendering(params.messages, tools), cache_scope=namespace)
            return tokenizer.encode_chat(params.messages, cache_scope=namespace)
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


def worker_body(parsed: ParsedGeneration, caller: Caller, started_at: datetime,
                route: str = "chat.completions") -> GenerateBody:
    """What the worker gets. The namespace (the prefix cache's tenant partition) comes from the
    caller's key or batch, never from the client. A non-streamed request without logprobs asks for
    the joined answer (`"stream": false`: one line per choice at the end, not one per token): the
    gateway has nothing to forward before the end, and a line per token costs it a wakeup and a
    parse each. Logprobs keep the per-token lines, whose texts set the legacy `text_offset`s exactly
    as when streamed. `billing` is what the worker keeps with the usage until this gateway has
    committed the usage row (gateway/billing/reconcile.py bills it if the gateway dies first). `weight`
    is the tenant's scheduling weight (the worker's fair scheduler divides its service by it)."""
    params = parsed.params
    sampling = {**params.sampling, "max_tokens": parsed.max_tokens}
    if params.logprobs is not None:
        sampling["logprobs"] = params.logprobs
        if params.echo:  # the prompt tokens' logprobs too (the engine recomputes a cached prompt for them)
            sampling["prompt_logprobs"] = params.logprobs
    billing: Billing = {"tenant_id": caller.tenant_id, "key_id": caller.key_id, "model": parsed.entry.name,
                        "batch_id": caller.batch_id, "started_at": started_at.isoformat(), "route": route}
    return generate_body(parsed.request_id, namespace_of(caller), parsed.prompt, sampling,
                         "batch" if caller.batch_id is not None else "interactive",
                         params.stream or params.logprobs is not None, billing, params.grammar,
                         caller.weight)


def namespace_of(caller: Caller) -> str:
    return f"tenant-{caller.tenant_id}"
