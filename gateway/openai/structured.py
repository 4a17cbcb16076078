"""Structured outputs at the gateway: `response_format` (chat) and `text.format` (Responses) become
the grammar the engine decodes under (workers/wire/grammar.py). Schemas are checked here with
`jsonschema` (a malformed one is a 400 naming it); what the engine's grammar compiler cannot honour
comes back from the worker as a 400 too. Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

from gateway.api.errors import invalid
from workers.wire.grammar import GrammarSpec

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """A JSON schema object valid under its own draft (2020-12 unless `$schema` says otherwise)."""
    if not isinstance(schema, dict):
        raise invalid("the schema must be a JSON object", param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise invalid(f"invalid JSON schema{f' at {where}' if where else ''}: {exc.message}", param) from exc
    return schema


def check_name(name: Any, param: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid("a name must be 1 to 64 letters, digits, underscores or dashes", param)
    return name


def json_schema_format(spec: Any, param: str) -> GrammarSpec:
    """`{name, schema, strict?, description?}` (chat's `json_schema` object, or the Responses
    `text.format` object itself) as a json_schema grammar."""
    if not isinstance(spec, dict):
        raise invalid("'json_schema' must be an object with 'name' and 'schema'", param)
    check_name(spec.get("name"), f"{param}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid("'strict' must be a boolean", f"{param}.strict")
    if "schema" not in spec:
        raise invalid("'schema' is required", f"{param}.schema")
    return GrammarSpec.json_schema(check_schema(spec["schema"], f"{param}.schema"))


def response_format_grammar(value: Any, param: str = "response_format") -> GrammarSpec | None:
    """Chat's `response_format`: text (None), json_object, or json_schema."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("'response_format' must be an object", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        return json_schema_format(value.get("json_schema"), f"{param}.json_schema")
    raise invalid("response_format.type must be 'text', 'json_object' or 'json_schema'", f"{param}.type")


def text_format_grammar(text: Any) -> GrammarSpec | None:
    """The Responses API's `text: {format: {type: text | json_object | json_schema, name, schema, strict}}`."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("'text.format' must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        return json_schema_format(fmt, "text.format")
    raise invalid("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format.type")
