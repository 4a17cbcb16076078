"""Splitting a choice's output into text and tool calls as it arrives (the format of tools.py).

`ToolCallParser.feed(piece)` returns events in output order:
- `Text(text)`: content; text that may still become `<tool_call>` is held back until it cannot;
- `CallStarted(call)`: `<tool_call>` and the call's name were read (`call.arguments` is "");
- `Arguments(call, text)`: more of the call's JSON arguments, exactly as the model wrote them (the
  tail that may be the wrapper's closing `}` + `</tool_call>` is held back until it is not);
- `CallEnded(call)`: the call's closing tag arrived; `call.arguments` is the whole JSON text.
Concatenating a call's `Arguments` gives `call.arguments`, so streamed and non-streamed answers
agree. Under a tools grammar the format is exact; free text that opens `<tool_call>` but is not a
call (no name header) stays text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.openai.tools import OPEN, ToolCall, new_call_id

CLOSE_ALL = "}\n</tool_call>"  # the wrapper object's brace, then the closing tag
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
MAX_HEADER_CHARS = 200  # past this without a name header, `<tool_call>` was just text


@dataclass
class Text:
    text: str


@dataclass
class CallStarted:
    call: ToolCall


@dataclass
class Arguments:
    call: ToolCall
    text: str


@dataclass
class CallEnded:
    call: ToolCall


Event = Text | CallStarted | Arguments | CallEnded


def _held(buffer: str, target: str) -> int:
    """Length of the longest tail of `buffer` that is a proper prefix of `target`."""
    return max((k for k in range(1, len(target)) if buffer.endswith(target[:k])), default=0)


class ToolCallParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._call: ToolCall | None = None  # the call whose arguments are streaming
        self.calls: list[ToolCall] = []

    def feed(self, piece: str) -> list[Event]:
        self._buffer += piece
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def _step(self, events: list[Event]) -> bool:
        """One state transition; False when more text is needed."""
        buffer = self._buffer
        if self._call is not None:  # inside a call's arguments
            end = buffer.find(CLOSE_ALL)
            if end != -1:
                self._arguments(events, buffer[:end])
                events.append(CallEnded(self._call))
                self._call, self._buffer = None, buffer[end + len(CLOSE_ALL):]
                return True
            keep = _held(buffer, CLOSE_ALL)
            self._arguments(events, buffer[: len(buffer) - keep])
            self._buffer = buffer[len(buffer) - keep:]
            return False
        start = buffer.find(OPEN)
        if start == -1:
            keep = _held(buffer, OPEN)
            self._text(events, buffer[: len(buffer) - keep])
            self._buffer = buffer[len(buffer) - keep:]
            return False
        self._text(events, buffer[:start])
        self._buffer = buffer = buffer[start:]
        header = HEADER.match(buffer, len(OPEN))
        if header is None:
            if len(buffer) - len(OPEN) <= MAX_HEADER_CHARS:
                return False  # the header may still be arriving
            self._text(events, OPEN)  # not a call: the tag was text
            self._buffer = buffer[len(OPEN):]
            return True
        self._call = ToolCall(new_call_id(), header.group(1), "")
        self.calls.append(self._call)
        events.append(CallStarted(self._call))
        self._buffer = buffer[header.end():]
        return True

    def _text(self, events: list[Event], text: str) -> None:
        if text and (text.strip() or not self.calls):  # whitespace between or after calls is no content
            events.append(Text(text))

    def _arguments(self, events: list[Event], text: str) -> None:
        if text and self._call is not None:
            self._call.arguments += text
            events.append(Arguments(self._call, text))

    def finish(self) -> list[Event]:
        """The output ended: what is held back comes out (an unfinished call keeps its partial
        arguments, as OpenAI's do when max_tokens cuts them)."""
        rest, self._buffer = self._buffer, ""
        if self._call is not None:
            events: list[Event] = []
            self._arguments(events, rest)
            self._call = None
            return events
        return [Text(rest)] if rest else []
