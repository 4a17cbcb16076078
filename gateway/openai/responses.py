"""OpenAI response objects built from worker deltas (pure functions, no I/O).

A worker delta is `{index, token_ids, text, finish_reason[, logprobs, top_logprobs][, usage]}`:
`logprobs[i]` is the chosen token's log-probability for `token_ids[i]` and `top_logprobs[i]` its
alternatives as `[token_id, logprob]` pairs. Token ids become strings with the gateway's tokenizer.

Completions with `echo`: each choice's text starts with the prompt (its text as sent; a prompt of
token ids decoded), and with `logprobs` its logprobs start with the prompt tokens', taken from the
`prompt_logprobs` of choice 0's first line (workers/wire/generate.py): the first prompt token's
logprob and top logprobs are null, as OpenAI's; `text_offset` counts each token's text from 0 and
the generated tokens go on from the prompt text's length. Streamed (n = 1 only), the prompt is a
chunk of its own before the choice's first one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.openai.sse import DONE, sse
from gateway.openai.tool_stream import Arguments, CallStarted, Event, Text, ToolCallParser
from gateway.openai.tools import ToolCall
from workers.wire.tokenizer import TextTokenizer


def usage_object(usage: dict[str, int]) -> dict[str, Any]:
    """OpenAI usage; `prompt_tokens_details.cached_tokens` is always present."""
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)}}


def _token_text(tokenizer: TextTokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: TextTokenizer, delta: dict[str, Any]) -> list[dict[str, Any]]:
    """The `logprobs.content` entries of one delta (chat format)."""
    entries = []
    tops = delta.get("top_logprobs") or [[] for _ in delta["token_ids"]]
    for token_id, logprob, top in zip(delta["token_ids"], delta["logprobs"], tops, strict=True):
        text = _token_text(tokenizer, token_id)
        entries.append({
            "token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := _token_text(tokenizer, alt)), "logprob": lp, "bytes": list(t.encode())}
                             for alt, lp in top],
        })
    return entries


def completion_logprobs(tokenizer: TextTokenizer, delta: dict[str, Any], text_offset: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object for one delta, offsets counted from `text_offset`."""
    tokens = [_token_text(tokenizer, t) for t in delta["token_ids"]]
    offsets, position = [], text_offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    tops = delta.get("top_logprobs") or [[] for _ in tokens]
    return {"tokens": tokens, "token_logprobs": list(delta["logprobs"]),
            "top_logprobs": [{_token_text(tokenizer, alt): lp for alt, lp in top} for top in tops],
            "text_offset": offsets}


@dataclass
class EchoedPrompt:
    """A completions request's prompt when `echo` is on: it opens every choice."""

    text: str
    token_ids: list[int]
    logprobs: dict[str, list[Any]] | None = None  # the prompt tokens' logprobs object, once a line brought them


def prompt_logprobs(tokenizer: TextTokenizer, token_ids: list[int], line: dict[str, Any]) -> dict[str, list[Any]]:
    """The legacy `logprobs` object of the prompt tokens from a worker line's `prompt_logprobs`
    (one per prompt token after the first); all null when the line has none (a request that ended
    before its prompt was computed)."""
    tokens = [_token_text(tokenizer, t) for t in token_ids]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    values, tops = line.get("prompt_logprobs"), line.get("prompt_top_logprobs")
    if values is None:
        return {"tokens": tokens, "token_logprobs": [None] * len(tokens), "top_logprobs": [None] * len(tokens),
                "text_offset": offsets}
    top_dicts = [{_token_text(tokenizer, alt): lp for alt, lp in top} for top in tops or [[] for _ in values]]
    return {"tokens": tokens, "token_logprobs": [None, *values], "top_logprobs": [None, *top_dicts],
            "text_offset": offsets}


def tool_call_deltas(calls: list[ToolCall], events: list[Event]) -> list[dict[str, Any]]:
    """OpenAI's `delta.tool_calls` for one chunk: a call's first entry has its id, type and name;
    later ones add argument text. One entry per call touched by the chunk."""
    entries: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, CallStarted):
            index = calls.index(event.call)
            entries[index] = {"index": index, "id": event.call.id, "type": "function",
                              "function": {"name": event.call.name, "arguments": ""}}
        elif isinstance(event, Arguments):
            index = calls.index(event.call)
            entry = entries.setdefault(index, {"index": index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += event.text
    return list(entries.values())


@dataclass
class ChoiceState:
    """What one choice has produced so far (non-streamed responses and logprob offsets)."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)
    completion_logprobs: dict[str, list[Any]] = field(
        default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
    text_len: int = 0
    parser: ToolCallParser | None = None  # when the request's tools are active
    last_text: str = ""  # the content of the delta absorbed last (without its tool calls)
    last_events: list[Event] = field(default_factory=list)  # its tool-call events

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.parser.calls if self.parser is not None else []

    def finish_reason_of(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.tool_calls else reason


@dataclass
class ResponseBuilder:
    """Turns the deltas of one request into OpenAI chunks (streaming) or one final object."""

    kind: Literal["chat", "completion"]
    id: str
    model: str
    created: int
    tokenizer: TextTokenizer
    logprobs: bool
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    tools: bool = False  # parse tool calls out of the output (gateway/openai/tools.py)
    echo: EchoedPrompt | None = None  # completions with `echo`: the prompt opens every choice
    _opened: set[int] = field(default_factory=set)  # choices whose opening chunk (chat: role; echo) was streamed

    def _choice(self, index: int) -> ChoiceState:
        state = self.choices.get(index)
        if state is None:
            state = self.choices[index] = ChoiceState(parser=ToolCallParser() if self.tools else None)
            if self.echo is not None:  # generated tokens' text offsets go on after the prompt's text
                state.text_len = len(self.echo.text)
        return state

    def _echo_logprobs(self, line: dict[str, Any] | None = None) -> dict[str, list[Any]]:
        """The prompt tokens' logprobs object: from `line` when it brings them, else as known."""
        assert self.echo is not None
        if (line is not None and "prompt_logprobs" in line) or self.echo.logprobs is None:
            self.echo.logprobs = prompt_logprobs(self.tokenizer, self.echo.token_ids, line or {})
        return self.echo.logprobs

    def _logprobs_of(self, delta: dict[str, Any], state: ChoiceState) -> Any:
        if not self.logprobs or delta.get("logprobs") is None:
            return None
        if self.kind == "chat":
            content = chat_logprobs(self.tokenizer, delta)
            state.chat_logprobs.extend(content)
            return {"content": content}
        part = completion_logprobs(self.tokenizer, delta, state.text_len)
        for key, values in part.items():
            state.completion_logprobs[key].extend(values)
        return part

    def absorb(self, delta: dict[str, Any]) -> Any:
        """Record one delta; returns its logprobs object (or None) for a streamed chunk."""
        state = self._choice(delta["index"])
        if self.echo is not None and self.logprobs and "prompt_logprobs" in delta:
            self._echo_logprobs(delta)
        logprobs = self._logprobs_of(delta, state)
        text, events = delta["text"], list[Event]()
        if state.parser is not None:
            events = state.parser.feed(text)
            if delta["finish_reason"] is not None:
                events += state.parser.finish()
            text = "".join(e.text for e in events if isinstance(e, Text))
        state.last_text, state.last_events = text, events
        state.text.append(text)
        state.text_len += len(text)
        if delta["finish_reason"] is not None:
            state.finish_reason = state.finish_reason_of(delta["finish_reason"])
        return logprobs

    def _header(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat streams open each choice with the assistant role."""
        return {**self._header("chat.completion.chunk"),
                "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}

    def chunk(self, delta: dict[str, Any]) -> dict[str, Any]:
        logprobs = self.absorb(delta)
        if self.kind == "chat":
            state = self.choices[delta["index"]]
            body: dict[str, Any] = {"content": state.last_text} if state.last_text else {}
            calls = tool_call_deltas(state.tool_calls, state.last_events)
            if calls:
                body["tool_calls"] = calls
            choice = {"index": delta["index"], "delta": body, "logprobs": logprobs,
                      "finish_reason": state.finish_reason_of(delta["finish_reason"])}
            return {**self._header("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": delta["index"], "text": delta["text"], "logprobs": logprobs,
                  "finish_reason": delta["finish_reason"]}
        return {**self._header("text_completion"), "choices": [choice]}

    # -- the stream protocol of gateway/upstream/exchange.py ----------------------------------------
    def stream_start(self) -> bytes:
        return b""

    def echo_chunk(self, line: dict[str, Any]) -> dict[str, Any]:
        """A streamed echo opens its choice with the prompt (and its logprobs, from this first line)."""
        assert self.echo is not None
        logprobs = self._echo_logprobs(line) if self.logprobs else None
        return {**self._header("text_completion"),
                "choices": [{"index": line["index"], "text": self.echo.text, "logprobs": logprobs,
                             "finish_reason": None}]}

    def stream_line(self, line: dict[str, Any]) -> bytes:
        """The SSE bytes of one worker line (chat opens each choice with its role chunk, an echo
        with its prompt)."""
        head = b""
        if line["index"] not in self._opened:
            self._opened.add(line["index"])
            if self.kind == "chat":
                head = sse(self.role_chunk(line["index"]))
            elif self.echo is not None:
                head = sse(self.echo_chunk(line))
        return head + sse(self.chunk(line))

    def stream_end(self, usage: dict[str, int], include_usage: bool) -> bytes:
        return (sse(self.usage_chunk(usage)) if include_usage else b"") + DONE

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._header(name), "choices": [], "usage": usage_object(usage)}

    def final(self, usage: dict[str, int]) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            state = self.choices[index]
            text = "".join(state.text)
            if self.kind == "chat":
                logprobs = {"content": state.chat_logprobs} if self.logprobs else None
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if state.tool_calls:
                    message["content"] = text.strip() or None
                    message["tool_calls"] = [call.chat() for call in state.tool_calls]
                choices.append({"index": index, "message": message, "logprobs": logprobs,
                                "finish_reason": state.finish_reason})
            else:
                logprobs = state.completion_logprobs if self.logprobs else None
                if self.echo is not None:
                    text = self.echo.text + text
                    if logprobs is not None:
                        prompt = self._echo_logprobs()
                        logprobs = {key: prompt[key] + values for key, values in logprobs.items()}
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": state.finish_reason})
        name = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._header(name), "choices": choices, "usage": usage_object(usage)}
