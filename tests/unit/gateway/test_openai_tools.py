"""Tools and structured outputs at the gateway, pure parts: parameter validation (400s naming the
field), the grammar a request gets, the default tool rendering, and splitting output into calls."""

from __future__ import annotations

import json

import pytest

from gateway.api.errors import ApiError
from gateway.openai.params import parse_request
from gateway.openai.responses import ResponseBuilder
from gateway.openai.structured import text_format_grammar
from gateway.openai.tool_stream import Arguments, CallEnded, CallStarted, Text, ToolCallParser
from gateway.openai.tools import default_rendering, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}


def chat(**fields):
    return parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_response_formats_become_grammars() -> None:
    assert chat().grammar is None and chat(response_format={"type": "text"}).grammar is None
    assert chat(response_format={"type": "json_object"}).grammar.kind == "json_object"
    spec = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "properties": {"z": {}, "a": {}}}}}).grammar
    assert spec.kind == "json_schema" and list(json.loads(spec.schema)["properties"]) == ["z", "a"]
    fmt = text_format_grammar({"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}})
    assert fmt is not None and fmt.schema == '{"type":"object"}'


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "low"}}}},
     "response_format.json_schema.schema", "invalid JSON schema at minimum"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not in 'tools'"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "function tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls", "assistant"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON string"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1"}]}]}, "messages[0].tool_calls[0]", "'id'"),
])
def test_bad_structure_is_a_400_naming_the_field(fields, param: str, message: str) -> None:
    with pytest.raises(ApiError) as error:
        chat(**fields)
    assert error.value.status == 400 and error.value.param == param and message in error.value.message


def test_tool_choices_shape_the_grammar() -> None:
    auto = chat(tools=[WEATHER, CLOCK]).grammar
    assert auto.kind == "tool_tags" and not auto.at_least_one and len(auto.tags) == 2
    assert json.loads(auto.tags[0].schema)["required"] == ["city"]
    assert json.loads(auto.tags[1].schema) == {"type": "object", "properties": {}}
    named = chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "clock"}})
    assert named.grammar.at_least_one and [t.begin for t in named.grammar.tags] == [
        '<tool_call>\n{"name": "clock", "arguments": ']
    assert chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).grammar.stop_after_first
    assert chat(tools=[WEATHER], tool_choice="none").grammar is None
    responses_style = parse_tools({"tools": [{"type": "function", "name": "clock"}], "tool_choice": "required"})
    assert responses_style is not None and responses_style.tools[0].name == "clock"


def test_a_conversation_with_calls_renders_in_the_default_format() -> None:
    request = chat(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    rendered = default_rendering(request.messages, request.tools)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"]
    assert rendered[0]["content"].startswith("Be brief.\n\nYou can call functions.") and "get_weather" in rendered[0][
        "content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert rendered[3]["content"] == "<tool_response>\nsunny\n</tool_response>"


def test_the_parser_streams_text_and_call_arguments_as_they_arrive() -> None:
    parser = ToolCallParser()
    pieces = ["Let me check. <tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Pa', 'ris"}', "}",
              "\n</tool_", "call>", "\n<tool_call>\n{\"name\": \"clock\", \"arguments\": {}}\n</tool_call>"]
    out = [parser.feed(piece) for piece in pieces]
    assert out[0] == [Text("Let me check. ")] and out[1] == []
    [started, first_args] = out[2]
    assert isinstance(started, CallStarted) and started.call.name == "get_weather" and started.call.id.startswith("call_")
    assert first_args == Arguments(started.call, '{"city": "Pa')
    assert out[3] == [Arguments(started.call, 'ris"')]  # its "}" may be the wrapper's: held back
    assert out[4] == [Arguments(started.call, "}")]  # a second "}" came: the first was the arguments''
    assert out[5] == [] and out[6] == [CallEnded(started.call)]
    assert json.loads(started.call.arguments) == {"city": "Paris"}
    assert [type(e) for e in out[7]] == [CallStarted, Arguments, CallEnded]  # the "\n" between calls is no content
    assert [c.name for c in parser.calls] == ["get_weather", "clock"] and parser.finish() == []


def test_an_unfinished_call_keeps_its_partial_arguments_and_a_fake_tag_stays_text() -> None:
    parser = ToolCallParser()
    parser.feed('<tool_call>\n{"name": "x", "arguments": {"a": 1')
    assert parser.finish() == [] and parser.calls[0].arguments == '{"a": 1'
    prose = ToolCallParser()
    events = prose.feed("<tool_call> is how I would call a tool, " + "really " * 40)
    assert "".join(e.text for e in events if isinstance(e, Text)).startswith("<tool_call> is how")
    assert prose.calls == []


def test_builder_turns_calls_into_tool_calls_and_streams_them_in_openai_shape() -> None:
    builder = ResponseBuilder("chat", "id", "m", 0, None, False, tools=True)  # type: ignore[arg-type]
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    first = builder.chunk({"index": 0, "text": text[:30], "token_ids": [1], "finish_reason": None})
    assert first["choices"][0]["delta"] == {}
    second = builder.chunk({"index": 0, "text": text[30:60], "token_ids": [2], "finish_reason": None})
    [opened] = second["choices"][0]["delta"]["tool_calls"]
    assert opened["index"] == 0 and opened["type"] == "function" and opened["function"]["name"] == "get_weather"
    last = builder.chunk({"index": 0, "text": text[60:], "token_ids": [3], "finish_reason": "stop"})
    [more] = last["choices"][0]["delta"]["tool_calls"]
    assert more == {"index": 0, "function": {"arguments": more["function"]["arguments"]}}
    assert json.loads(opened["function"]["arguments"] + more["function"]["arguments"]) == {"city": "Paris"}
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    final = builder.final({"prompt_tokens": 3, "completion_tokens": 2})
    message = final["choices"][0]["message"]
    assert message["content"] is None and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris"}
    assert final["choices"][0]["finish_reason"] == "tool_calls"
