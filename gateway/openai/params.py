"""Validation of OpenAI request bodies into what a worker needs (pure: no I/O).

Every bad field is a 400 naming the parameter. Fields the engine cannot honour (legacy `functions`,
logit_bias, `suffix`, ...) are refused clearly rather than silently ignored. Completions take `echo`
(the prompt before the completion; with `logprobs`, the prompt tokens' logprobs too, as evaluation
harnesses ask for them) and then `max_tokens` 0 (the prompt alone). Structured outputs
(`response_format`) and tools become the request's grammar (gateway/openai/structured.py, tools.py). tollway also takes vLLM-style
extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`), which the SDK sends via `extra_body`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.api.errors import invalid
from gateway.openai.structured import response_format_grammar
from gateway.openai.tools import ToolConfig, parse_tools
from workers.wire.grammar import GrammarSpec

MAX_N = 16
MAX_STOP = 4
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
UNSUPPORTED = ("functions", "function_call", "suffix", "best_of", "audio", "prediction")
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "response_format")


GenerationKind = Literal["chat", "completion"]


@dataclass
class GenerationRequest:
    """One validated `/v1/chat/completions` or `/v1/completions` request."""

    kind: GenerationKind
    model: str
    # chat: roles and plain-text contents; assistant `tool_calls` and tool `tool_call_id` when present
    messages: list[dict[str, Any]] | None = None
    prompt_text: str | None = None  # completion given as text
    prompt_ids: list[int] | None = None  # completion given as token ids
    max_tokens: int | None = None  # None = up to the model's context
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None = off; k = chosen token plus top k
    echo: bool = False  # completions: the prompt comes first in each choice's text (and logprobs)
    sampling: dict[str, Any] = field(default_factory=dict)  # worker sampling fields, without max_tokens
    user: str | None = None
    grammar: GrammarSpec | None = None  # what the output must match (response_format or tools)
    tools: ToolConfig | None = None

    @property
    def n(self) -> int:
        return int(self.sampling.get("n", 1))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise invalid(f"'{name}' must be between {low:g} and {high:g}, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if _is_int(value) and value >= low and (high is None or value <= high):
        return value
    bound = f"between {low} and {high}" if high is not None else f"at least {low}"
    if not _is_int(value):  # JSON integers beyond 64 bits arrive as floats: the bound says why they fail
        raise invalid(f"'{name}' must be an integer {bound}", name)
    raise invalid(f"'{name}' must be {bound}, got {value}", name)


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean", name)
    return value


def _stop(body: dict[str, Any]) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"'stop' takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    return stops


def _message_content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid("only text content parts ({'type': 'text', 'text': ...}) are supported",
                              f"messages[{index}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid("message content must be a string or a list of text parts", f"messages[{index}].content")


def _tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise invalid("'tool_calls' must be a non-empty list", param)
    parsed = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(call, dict) or not isinstance(call.get("id"), str) or not call["id"]
                or call.get("type", "function") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str)):
            raise invalid("each tool call needs an 'id', 'type': 'function' and a 'function' with 'name' and "
                          "'arguments' (a JSON string)", f"{param}[{j}]")
        try:
            json.loads(function["arguments"])
        except ValueError as exc:
            raise invalid("'arguments' must be a JSON string", f"{param}[{j}].function.arguments") from exc
        parsed.append({"id": call["id"], "type": "function",
                       "function": {"name": function["name"], "arguments": function["arguments"]}})
    return parsed


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    parsed: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid("each message must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"unknown role {role!r}; expected one of {', '.join(sorted(ROLES))}", f"messages[{i}].role")
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": _message_content(message.get("content"), i)}
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise invalid("only assistant messages carry 'tool_calls'", f"messages[{i}].tool_calls")
            entry["tool_calls"] = _tool_calls(message["tool_calls"], i)
            call_ids.update(call["id"] for call in entry["tool_calls"])
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in call_ids:
                raise invalid("a tool message needs the 'tool_call_id' of an earlier assistant tool call",
                              f"messages[{i}].tool_call_id")
            entry["tool_call_id"] = call_id
        parsed.append(entry)
    return parsed


def _prompt(body: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("one prompt per request; send several requests (or use /v1/batches)", "prompt")
    raise invalid("'prompt' must be a string or a non-empty list of token ids", "prompt")


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0),
        "min_p": _number(body, "min_p", 0.0, 1.0),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.01, 10.0),
        "seed": _integer(body, "seed", -(2**63), 2**63 - 1),
        "n": _integer(body, "n", 1, MAX_N),
        "stop": _stop(body),
    }
    if values["top_p"] == 0.0:
        raise invalid("'top_p' must be greater than 0", "top_p")
    top_k = _integer(body, "top_k", -1)
    values["top_k"] = None if top_k in (None, -1) else top_k  # vLLM spells "off" as -1, the engine as 0
    if _boolean(body, "ignore_eos"):
        values["ignore_eos"] = True
    return {name: value for name, value in values.items() if value is not None}


def _refuse_unsupported(kind: GenerationKind, body: dict[str, Any]) -> None:
    for name in UNSUPPORTED + (CHAT_ONLY if kind == "completion" else ()):
        if body.get(name) not in (None, [], {}):
            raise invalid(f"'{name}' is not supported by this server{' on completions' * (name in CHAT_ONLY)}",
                          name)
    if body.get("logit_bias"):
        raise invalid("'logit_bias' is not supported by this server", "logit_bias")


def _structure(body: dict[str, Any]) -> tuple[GrammarSpec | None, ToolConfig | None]:
    """The grammar of a chat request: its tools' (unless tool_choice is none) or its response_format's."""
    tools = parse_tools(body)
    grammar = response_format_grammar(body.get("response_format"))
    if tools is not None and tools.active:
        if grammar is not None:
            raise invalid("'response_format' cannot be combined with tools unless 'tool_choice' is 'none'",
                          "response_format")
        grammar = tools.grammar()
    return grammar, tools


def parse_request(kind: GenerationKind, body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise invalid("'model' is required", "model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' must be a non-empty string (a model id from GET /v1/models)", "model")
    _refuse_unsupported(kind, body)
    request = GenerationRequest(kind=kind, model=model, sampling=_sampling(body))
    if kind == "chat":
        request.messages = _messages(body)
        request.grammar, request.tools = _structure(body)
        max_tokens = _integer(body, "max_completion_tokens", 1)
        request.max_tokens = max_tokens if max_tokens is not None else _integer(body, "max_tokens", 1)
        if _boolean(body, "logprobs"):
            request.logprobs = _integer(body, "top_logprobs", 0, 20) or 0
        elif body.get("top_logprobs") is not None:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        request.prompt_text, request.prompt_ids = _prompt(body)
        request.echo = _boolean(body, "echo")
        request.max_tokens = _integer(body, "max_tokens", 0)
        request.logprobs = _integer(body, "logprobs", 0, 5)
        if request.max_tokens == 0 and not request.echo:
            raise invalid("'max_tokens' must be at least 1 (0 is allowed with 'echo': true: the prompt alone)",
                          "max_tokens")
        if request.max_tokens == 0 and request.n > 1:
            raise invalid("'max_tokens' 0 (the echoed prompt alone) takes 'n' 1", "n")
    request.stream = _boolean(body, "stream")
    if request.echo and request.stream and request.n > 1:
        raise invalid("'echo' with 'n' > 1 cannot be streamed; send 'stream': false or 'n': 1", "echo")
    options = body.get("stream_options")
    if options is not None:
        if not request.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object", "stream_options")
        request.include_usage = _boolean(options, "include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string", "user")
    request.user = user
    return request
