"""Tool calling: `tools`, `tool_choice`, `parallel_tool_calls` → the prompt, the grammar, the calls.

The call format (the model's own when its chat template renders `tools`, else this documented
default, Hermes/Qwen style, told to the model in a system message):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The engine decodes under a `tool_tags` grammar (workers/wire/grammar.py) whose tags are exactly that,
one per tool, with the arguments constrained by the tool's `parameters` schema:
- `auto`: free text in which `<tool_call>` opens a well-formed call;
- `required`: one call or more and nothing else; a named function: calls of that function only;
- `none`: no grammar, no parsing (the tools are not shown to the model);
- `parallel_tool_calls: false`: the output stops after its first call.
gateway/openai/tool_stream.py splits the output into content and calls as it streams. Pure: no I/O.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.api.errors import invalid
from gateway.openai.structured import check_name, check_schema
from workers.wire.grammar import GrammarSpec, TagSpec, canonical_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def definition(self) -> dict[str, Any]:
        """The OpenAI shape, as chat templates and the default system message show it."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolConfig:
    tools: tuple[Tool, ...]
    choice: str  # none | auto | required | named
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> GrammarSpec | None:
        if not self.active:
            return None
        tools = [t for t in self.tools if self.named is None or t.name == self.named]
        tags = tuple(TagSpec(f'{OPEN}\n{{"name": {canonical_json(t.name)}, "arguments": ', canonical_json(t.parameters),
                             f"}}\n{CLOSE}") for t in tools)
        return GrammarSpec("tool_tags", tags=tags, triggers=(OPEN,), at_least_one=self.choice in ("required", "named"),
                           stop_after_first=not self.parallel)

    def system_text(self) -> str:
        """The default tool instructions (templates without their own tool format)."""
        listed = "\n".join(orjson.dumps(t.definition()).decode() for t in self.tools)
        return (f'You can call functions. To call one, reply with {OPEN}\n{{"name": ..., "arguments": ...}}\n{CLOSE}\n'
                f"Functions:\n{listed}")


def parse_tools(body: dict[str, Any], tools_key: str = "tools") -> ToolConfig | None:
    """`tools` (chat: `{type: function, function: {...}}`; Responses: `{type: function, name, ...}`),
    `tool_choice` and `parallel_tool_calls`; None when no tools are given."""
    raw, choice = body.get(tools_key), body.get("tool_choice")
    if raw in (None, []):
        if choice not in (None, "none", "auto"):
            raise invalid("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise invalid("'tools' must be a list", "tools")
    tools = []
    for i, item in enumerate(raw):
        param = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            raise invalid("only function tools ({'type': 'function', ...}) are supported", param)
        spec = item.get("function", item)  # chat nests the function; the Responses API does not
        if not isinstance(spec, dict):
            raise invalid("'function' must be an object", f"{param}.function")
        name = check_name(spec.get("name"), f"{param}.name")
        description = spec.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid("'description' must be a string", f"{param}.description")
        parameters = spec.get("parameters")
        parameters = NO_PARAMETERS if parameters is None else check_schema(parameters, f"{param}.parameters")
        tools.append(Tool(name, description, parameters))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tool names must be unique", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolConfig(tuple(tools), choice or "auto", None, parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        named = choice.get("function", choice)
        chosen = named.get("name") if isinstance(named, dict) else None
        if not isinstance(chosen, str) or chosen not in names:
            raise invalid(f"'tool_choice' names the function {chosen!r}, which is not in 'tools'", "tool_choice")
        return ToolConfig(tuple(tools), "named", chosen, parallel)
    raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', ...}", "tool_choice")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_text(name: str, arguments: str) -> str:
    """One call as the default format writes it (past assistant turns in a prompt)."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        value = arguments
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(value, ensure_ascii=False)}}}\n{CLOSE}'


def default_rendering(messages: list[dict[str, Any]], config: ToolConfig | None) -> list[dict[str, Any]]:
    """Messages with tool calls and tool results written out in the default format, plus the tool
    instructions in the system message: for chat templates that know nothing of tools."""
    rendered = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        elif message["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        rendered.append({"role": message["role"], "content": content})
    if config is not None and config.active:
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{config.system_text()}"}
        else:
            rendered.insert(0, {"role": "system", "content": config.system_text()})
    return rendered


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def chat(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
