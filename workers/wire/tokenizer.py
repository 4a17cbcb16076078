"""Prompt tokenization from a model's tokenizer files: `tokenizers` + its chat template (jinja2), no
torch. The gateway tokenizes every prompt with it; offline generation (`tollway generate --chat`) too.

Built from a model's tokenizer files as a worker serves them on `GET /internal/tokenizer`
(`tokenizer.json`, `tokenizer_config.json` with the special tokens, and the chat template from
`chat_template.jinja` or the config's `chat_template` key). Templates render in a sandbox with the
same options and helpers Hugging Face uses, so prompts tokenize identically.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from workers.wire.chatml import ChatML
from workers.wire.token_segments import SegmentEncoder


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages do not fit it."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, special_tokens: dict[str, str | None], chat_template: str | None):
        self._tokenizer = tokenizer
        self._segments = SegmentEncoder.for_tokenizer(tokenizer)  # None: whole texts only
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self._chatml: ChatML | None = None  # the template written without Jinja (workers/wire/chatml.py)
        if chat_template is not None:
            self._chatml = ChatML.recognize(chat_template, self._render_jinja)

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> TextTokenizer:
        """From `{"tokenizer_json": str, "tokenizer_config": dict, "chat_template": str | None}`."""
        tokenizer = Tokenizer.from_str(payload["tokenizer_json"])
        config = payload.get("tokenizer_config") or {}
        template = payload.get("chat_template") or config.get("chat_template")
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        return cls(tokenizer, {n: _token_text(config.get(n)) for n in names}, template)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, cache_scope: str = "") -> list[int]:
        """The text's token ids. Without special tokens added (a rendered chat prompt), pieces between
        added tokens come from a cache kept per `cache_scope` (see workers/wire/token_segments.py)."""
        if not add_special_tokens and self._segments is not None:
            return self._segments.encode(text, cache_scope)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template has its own tool format (it reads `tools` / `tool_calls`)."""
        return self.chat_template is not None and "tool_calls" in self.chat_template and "tools" in self.chat_template

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for a conversation (special tokens written out by the template); `tools`
        (OpenAI function definitions) reach templates that render them."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        if self._chatml is not None and tools is None and ChatML.renders(messages):
            return self._chatml.render(messages, add_generation_prompt)
        return self._render_jinja(messages, add_generation_prompt, tools)

    def _render_jinja(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                      tools: list[dict[str, Any]] | None = None) -> str:
        assert self.chat_template is not None
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **self.special_tokens
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, cache_scope: str = "") -> list[int]:
        # The template writes the special tokens itself, so none are added here (as transformers does).
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False,
                           cache_scope=cache_scope)
