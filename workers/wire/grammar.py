"""What a request's output must match: the grammar the engine constrains decoding with.

The gateway builds a `GrammarSpec` from `response_format`, `tools` / `tool_choice` or the
Responses API's `text.format` (gateway/openai/structured.py) and sends it as the generate body's
`grammar` field; the worker compiles it (workers/engine/grammar.py, cached by `key`) and masks
every sampling step with it. Torch-free, and free of the grammar library: the gateway must not load it.

Kinds:
- `json_object`: any JSON object.
- `json_schema`: a JSON value valid against `schema` (JSON text).
- `tool_tags`: free text, in which each `trigger` opens a structured part: `begin`, a JSON value
  valid against the tag's schema, then `end` (tool calls). `at_least_one`: the output is tags only,
  at least one (`tool_choice` required or named); `stop_after_first`: at most one tag
  (`parallel_tool_calls: false`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import orjson

GrammarKind = Literal["json_object", "json_schema", "tool_tags"]
KINDS = ("json_object", "json_schema", "tool_tags")
MAX_GRAMMAR_BYTES = 256 * 2**10


class GrammarSpecError(ValueError):
    """A malformed grammar field (the caller's mistake: a 400)."""


@dataclass(frozen=True)
class TagSpec:
    begin: str  # written out verbatim once a trigger starts it
    schema: str  # JSON text of the schema the value after `begin` must match
    end: str


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    schema: str | None = None  # json_schema: the schema as compact JSON text
    tags: tuple[TagSpec, ...] = ()  # tool_tags
    triggers: tuple[str, ...] = ()  # tool_tags: each tag's begin starts with one of these
    at_least_one: bool = False  # tool_tags: no free text, one tag or more
    stop_after_first: bool = False  # tool_tags: the output ends after its first tag

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> GrammarSpec:
        return cls("json_schema", canonical_json(schema))

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.kind}
        if self.schema is not None:
            body["schema"] = self.schema
        if self.kind == "tool_tags":
            body["tags"] = [{"begin": t.begin, "schema": t.schema, "end": t.end} for t in self.tags]
            body["triggers"] = list(self.triggers)
            body["at_least_one"], body["stop_after_first"] = self.at_least_one, self.stop_after_first
        return body

    @property
    def key(self) -> str:
        """The compiled-grammar cache key: a hash of the canonical spec."""
        return hashlib.sha256(orjson.dumps(self.to_json(), option=orjson.OPT_SORT_KEYS)).hexdigest()


def canonical_json(value: Any) -> str:
    """Compact JSON text; key order kept (a schema's property order is the output's order)."""
    return orjson.dumps(value).decode()


def _string(raw: dict[str, Any], name: str) -> str:
    value = raw.get(name)
    if not isinstance(value, str):
        raise GrammarSpecError(f"grammar.{name} must be a string")
    return value


def _schema_text(raw: dict[str, Any], name: str) -> str:
    text = _string(raw, name)
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise GrammarSpecError(f"grammar.{name} is not JSON: {exc}") from exc
    if not isinstance(parsed, dict | bool):
        raise GrammarSpecError(f"grammar.{name} must be a JSON schema object")
    return text


def parse_grammar(raw: Any) -> GrammarSpec | None:
    """The generate body's `grammar` field (None when absent); GrammarSpecError when malformed."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise GrammarSpecError("grammar must be an object")
    if len(orjson.dumps(raw)) > MAX_GRAMMAR_BYTES:
        raise GrammarSpecError(f"grammar is larger than {MAX_GRAMMAR_BYTES} bytes")
    kind = raw.get("type")
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        return GrammarSpec("json_schema", _schema_text(raw, "schema"))
    if kind == "tool_tags":
        tags, triggers = raw.get("tags"), raw.get("triggers")
        if not isinstance(tags, list) or not tags or not all(isinstance(t, dict) for t in tags):
            raise GrammarSpecError("grammar.tags must be a non-empty list of objects")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise GrammarSpecError("grammar.triggers must be a non-empty list of strings")
        specs = tuple(TagSpec(_string(t, "begin"), _schema_text(t, "schema"), _string(t, "end")) for t in tags)
        if not all(any(s.begin.startswith(trigger) for trigger in triggers) for s in specs):
            raise GrammarSpecError("every grammar tag must begin with one of the triggers")
        flags = [raw.get(name, False) for name in ("at_least_one", "stop_after_first")]
        if not all(isinstance(flag, bool) for flag in flags):
            raise GrammarSpecError("grammar.at_least_one and grammar.stop_after_first must be booleans")
        return GrammarSpec("tool_tags", tags=specs, triggers=tuple(triggers), at_least_one=flags[0],
                           stop_after_first=flags[1])
    raise GrammarSpecError(f"grammar.type must be one of {', '.join(KINDS)}")
