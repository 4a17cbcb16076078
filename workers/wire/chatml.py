"""ChatML prompts written without Jinja, for chat templates whose source is the plain ChatML loop.

Rendering a chat template with jinja2 costs ~25 us a request (SmolLM2's, a one-message chat), the
largest single piece of the gateway's CPU per request after HTTP itself (ops/bench/RESULTS.md). Many
models ship the same few-line ChatML template:

    {% for message in messages %}[default system message if the first is not one]
    {{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}
    {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}

`ChatML.recognize` accepts a template only when its source is exactly that form (spaces inside `{{ }}`
and `\\n` spelled either way aside), with at most a literal default system message, and only when the
two renderings then agree on a set of probe conversations. Anything else (tools, other formats, a
template with any other logic) keeps rendering with Jinja, as does any call it cannot write the same
way: tools given, or a message whose role or content is not a string (Jinja decides what those do).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_NEWLINE = r"(?:\n|\\n)"  # a newline in a Jinja string literal: written out, or escaped
_SOURCE = re.compile(
    r"\{% for message in messages %\}"
    r"(?:\{% if loop\.first and messages\[0\]\['role'\] != 'system' %\}"
    r"\{\{ ?'<\|im_start\|>system" + _NEWLINE + r"(?P<system>[^'\\{}%\n]*)<\|im_end\|>" + _NEWLINE + r"' ?\}\}"
    r"\{% endif %\})?"
    r"\{\{ ?'<\|im_start\|>' \+ message\['role'\] \+ '" + _NEWLINE + r"' \+ message\['content'\] \+ "
    r"'<\|im_end\|>' \+ '" + _NEWLINE + r"' ?\}\}"
    r"\{% endfor %\}"
    r"\{% if add_generation_prompt %\}\{\{ ?'<\|im_start\|>assistant" + _NEWLINE + r"' ?\}\}\{% endif %\}\n?"
)

PROBES: list[list[dict[str, Any]]] = [
    [],
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    [{"role": "tool", "content": "{{ '%}' }} \\n\n<|im_end|>"}, {"role": "system", "content": ""}],
]
"""Conversations both renderings must write alike before the fast one is used (with and without the
generation prompt)."""


class ChatML:
    def __init__(self, default_system: str | None) -> None:
        self._default_system = default_system

    @classmethod
    def recognize(cls, source: str, jinja_render: Callable[[list[dict[str, Any]], bool], str]) -> ChatML | None:
        """The fast renderer for `source`, or None when it is not the ChatML loop or the probes'
        renderings differ from `jinja_render(messages, add_generation_prompt)`."""
        matched = _SOURCE.fullmatch(source)
        if matched is None:
            return None
        chatml = cls(matched.group("system"))
        try:
            for messages in PROBES:
                for generation_prompt in (True, False):
                    if chatml.render(messages, generation_prompt) != jinja_render(messages, generation_prompt):
                        return None
        except Exception:  # Jinja refused a probe: it decides every call then
            return None
        return chatml

    @staticmethod
    def renders(messages: list[dict[str, Any]]) -> bool:
        """Whether `render` writes these messages as Jinja would (every role and content a str)."""
        return all(type(message) is dict and type(message.get("role")) is str and type(message.get("content")) is str
                   for message in messages)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        parts = []
        if messages and self._default_system is not None and messages[0]["role"] != "system":
            parts.append(f"<|im_start|>system\n{self._default_system}<|im_end|>\n")
        parts.extend(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n" for message in messages)
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)
