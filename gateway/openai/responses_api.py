"""`POST /v1/responses` (the Responses API), stateless: nothing is stored (`store` is accepted and
ignored; `previous_response_id` is refused), so every request carries its whole conversation.

A Responses body is read as the chat request it amounts to (`parse_responses`): `instructions`
become the system message, `input` (a string, or message / function_call / function_call_output
items) the messages, `max_output_tokens` the budget, `text.format` the grammar, `tools` (flat
function tools) and `tool_choice` as on chat. It then runs the chat pipeline (views.py), metered
with route `responses`. `ResponsesBuilder` answers in the Responses shape: one `response` object,
or the documented event stream (`response.created`, `response.in_progress`, output items with
`response.output_text.delta` / `response.function_call_arguments.delta`, `response.completed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.api.errors import ApiError, invalid
from gateway.openai.params import GenerationRequest, parse_request
from gateway.openai.structured import text_format_grammar
from gateway.openai.tool_stream import Arguments, CallEnded, CallStarted, Event, Text, ToolCallParser
from gateway.openai.tools import ToolCall, new_call_id

REFUSED = ("previous_response_id", "conversation", "background", "prompt")
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise invalid("only text content parts (input_text, output_text) are supported", f"{param}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid("content must be a string or a list of text parts", param)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a string or a non-empty list of items", "input")
    call_ids: set[str] = set()  # of the function_call items so far: each output must answer one of them
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in INPUT_ROLES:
            messages.append({"role": item["role"], "content": _content(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            if isinstance(item.get("call_id"), str):
                call_ids.add(item["call_id"])
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # consecutive calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise invalid("a function_call_output needs 'output' as a string", f"{param}.output")
            if item.get("call_id") not in call_ids:
                raise invalid("a function_call_output needs the 'call_id' of an earlier function_call item",
                              f"{param}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        else:
            raise invalid("each input item must be a message (role user, system, developer or assistant), "
                          "a function_call or a function_call_output", param)
    return messages


def parse_responses(body: Any) -> GenerationRequest:
    """A Responses body as a validated chat request (400s name the Responses fields where they differ)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name in REFUSED:
        if body.get(name) is not None:
            raise invalid(f"'{name}' is not supported: this server stores no responses; send the whole input", name)
    for name in ("n", "messages", "max_tokens", "response_format"):
        if name in body:
            raise invalid(f"'{name}' is not a Responses API parameter", name)
    chat: dict[str, Any] = {key: body[key] for key in ("model", "temperature", "top_p", "stream", "user", "tools",
                                                       "tool_choice", "parallel_tool_calls", "top_k", "seed")
                            if key in body}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    try:
        request = parse_request("chat", chat)
    except ApiError as exc:  # name the Responses field, not the chat one it was read as
        if exc.param == "max_completion_tokens":
            exc.param = "max_output_tokens"
            exc.message = exc.message.replace("'max_completion_tokens'", "'max_output_tokens'")
        elif exc.param is not None and exc.param.startswith("messages"):
            exc.param = "input"
        raise
    text_grammar = text_format_grammar(body.get("text"))
    if text_grammar is not None:
        if request.tools is not None and request.tools.active:
            raise invalid("'text.format' cannot be combined with tools unless 'tool_choice' is 'none'", "text.format")
        request.grammar = text_grammar
    return request


def usage_object(usage: dict[str, int]) -> dict[str, Any]:
    """The Responses usage shape."""
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


@dataclass
class ResponsesBuilder:
    """One response (a single choice) from worker lines; see the module docstring for the events."""

    id: str
    model: str
    created: int
    echo: dict[str, Any]  # request fields the response object repeats (instructions, tools, text, ...)
    tools: bool = False
    choices: dict[int, Any] = field(default_factory=dict)  # unused: one choice (the exchange clears it)
    _text: list[str] = field(default_factory=list)
    _parser: ToolCallParser | None = None
    _finish: str | None = None
    _message_id: str = field(default_factory=lambda: f"msg_{new_call_id()[5:]}")
    _message_index: int | None = None  # the output index of the text item, once opened
    _sequence: int = 0
    _ended: set[str] = field(default_factory=set)  # ids of the calls whose closing events were sent

    def __post_init__(self) -> None:
        self._parser = ToolCallParser() if self.tools else None

    @property
    def _calls(self) -> list[ToolCall]:
        return self._parser.calls if self._parser is not None else []

    def absorb(self, delta: dict[str, Any]) -> list[Event]:
        """Record one worker line; its events (text, and tool-call progress when tools are active)."""
        events: list[Event] = [Text(delta["text"])] if delta["text"] else []
        if self._parser is not None:
            events = self._parser.feed(delta["text"])
            if delta["finish_reason"] is not None:
                events += self._parser.finish()
        self._text.extend(e.text for e in events if isinstance(e, Text))
        if delta["finish_reason"] is not None:
            self._finish = delta["finish_reason"]
        return events

    # -- objects --------------------------------------------------------------------------------------
    def _message_item(self, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": "".join(self._text), "annotations": []}] if status == "completed" \
            else []
        return {"type": "message", "id": self._message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call.id[5:]}", "call_id": call.id, "name": call.name,
                "arguments": call.arguments if status == "completed" else "", "status": status}

    def _output(self) -> list[dict[str, Any]]:
        items = [self._message_item("completed")] if "".join(self._text).strip() or not self._calls else []
        return items + [self._call_item(call) for call in self._calls]

    def response(self, status: str, usage: dict[str, int] | None = None) -> dict[str, Any]:
        incomplete = status == "completed" and self._finish == "length"
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": "incomplete" if incomplete else status, "model": self.model,
                "output": self._output() if status != "in_progress" else [],
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "error": None, "usage": usage_object(usage) if usage is not None else None,
                "store": False, "previous_response_id": None, "metadata": {}, "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": [], "truncation": "disabled", **self.echo}

    def final(self, usage: dict[str, int]) -> dict[str, Any]:
        return self.response("completed", usage)

    # -- events -----------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def stream_start(self) -> bytes:
        return (self._event("response.created", response=self.response("in_progress"))
                + self._event("response.in_progress", response=self.response("in_progress")))

    def _text_done(self) -> bytes:
        if self._message_index is None:
            return b""
        where = {"item_id": self._message_id, "output_index": self._message_index, "content_index": 0}
        text = "".join(self._text)
        return (self._event("response.output_text.done", **where, text=text, logprobs=[])
                + self._event("response.content_part.done", **where,
                              part={"type": "output_text", "text": text, "annotations": []})
                + self._event("response.output_item.done", output_index=self._message_index,
                              item=self._message_item("completed")))

    def _call_index(self, call: ToolCall) -> int:
        return (1 if self._message_index is not None else 0) + self._calls.index(call)

    def stream_line(self, line: dict[str, Any]) -> bytes:
        out = b""
        for event in self.absorb(line):
            if isinstance(event, Text):
                if self._message_index is None:
                    self._message_index = 0
                    out += self._event("response.output_item.added", output_index=0,
                                       item=self._message_item("in_progress"))
                    out += self._event("response.content_part.added", item_id=self._message_id, output_index=0,
                                       content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                out += self._event("response.output_text.delta", item_id=self._message_id, output_index=0,
                                   content_index=0, delta=event.text, logprobs=[])
            elif isinstance(event, CallStarted):
                out += self._event("response.output_item.added", output_index=self._call_index(event.call),
                                   item=self._call_item(event.call, "in_progress"))
            elif isinstance(event, Arguments):
                out += self._event("response.function_call_arguments.delta", item_id=f"fc_{event.call.id[5:]}",
                                   output_index=self._call_index(event.call), delta=event.text)
            elif isinstance(event, CallEnded):
                out += self._call_done(event.call)
        return out

    def _unfinished_calls_done(self) -> bytes:
        """Calls max_output_tokens cut short still get their closing events (partial arguments)."""
        return b"".join(self._call_done(call) for call in self._calls if call.id not in self._ended)

    def _call_done(self, call: ToolCall) -> bytes:
        self._ended.add(call.id)
        index = self._call_index(call)
        return (self._event("response.function_call_arguments.done", item_id=f"fc_{call.id[5:]}",
                            output_index=index, arguments=call.arguments)
                + self._event("response.output_item.done", output_index=index, item=self._call_item(call)))

    def stream_end(self, usage: dict[str, int], include_usage: bool) -> bytes:
        body = self.final(usage)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return self._text_done() + self._unfinished_calls_done() + self._event(kind, response=body)
