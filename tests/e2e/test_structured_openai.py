"""What agent frameworks send, through the real `openai` SDK against `tollway up` on the default model:
`chat.completions.parse` with a Pydantic model, tool calling (required, named, streamed, and the
follow-up turn carrying the tool result), the Responses API (plain, streamed, json_schema
`text.format`) billed with route `responses`, and bad structure refused with 400s."""

from __future__ import annotations

import enum
import json
import sqlite3
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.tollway_up import Tollway, start_tollway

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"],
    "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    favorite_color: Color
    hobbies: list[str] = Field(max_length=3)
    address: Address


@pytest.fixture(scope="module")
def tollway(smollm2_folder: Path, model_home: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_tollway(tmp_path_factory.mktemp("up") / "home", model_home, TOLLWAY_DTYPE="float32")
    yield running
    if running.process.poll() is None:
        running.stop()


@pytest.fixture(scope="module")
def client(tollway: Tollway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tollway.base_url}/v1", api_key=tollway.new_key("agents"), max_retries=0,
                         timeout=120)


@pytest.mark.parametrize("prompt", [
    "Invent a person who lives in Lyon and likes painting.",
    "Describe a retired teacher from Boston as a record.",
    "Make up a young engineer who loves the color blue.",
])
def test_parse_returns_a_pydantic_instance(client: openai.OpenAI, prompt: str) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": prompt}],
        response_format=Person, max_tokens=200, temperature=0)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person) and isinstance(message.parsed.address, Address)
    assert Person.model_validate_json(message.content or "") == message.parsed


def test_json_object_mode_gives_an_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: still a valid prefix of an object
        assert (completion.choices[0].message.content or "").startswith("{")


def assert_valid_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_required_and_named_tool_calls_validate(client: openai.OpenAI) -> None:
    required = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=120, temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_valid_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    named = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=120, temperature=0)
    [call] = named.choices[0].message.tool_calls or []
    assert_valid_call(call, TIME)


def test_streamed_tool_call_deltas_assemble_and_the_follow_up_turn_is_accepted(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice={"type": "function",
                                                                         "function": {"name": "get_weather"}},
        parallel_tool_calls=False, max_tokens=120, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    argument_deltas = 0
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            argument_deltas += bool(delta.function and delta.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert argument_deltas > 2  # the arguments stream as they are decoded
    call = calls[0]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
    follow_up = client.chat.completions.create(model=MODEL, tools=[WEATHER], max_tokens=30, temperature=0, messages=[
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"forecast": "sunny", "high": 24}'},
    ])
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow_up.usage is not None and follow_up.usage.prompt_tokens > 50


def test_responses_plain_streamed_and_structured_are_billed_as_responses(client: openai.OpenAI,
                                                                          tollway: Tollway) -> None:
    plain = client.responses.create(model=MODEL, instructions="Answer in one short sentence.",
                                    input="What is the capital of France?", max_output_tokens=16, temperature=0,
                                    store=False)
    assert plain.output_text.strip() and plain.usage is not None and plain.usage.output_tokens <= 16
    assert plain.usage.input_tokens > 0
    events = list(client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    # OpenAI's last event: response.completed, or response.incomplete when max_output_tokens cut it
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text and final.usage is not None and final.usage.output_tokens <= 8
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=60, temperature=0) as stream:
        streamed = stream.get_final_response()  # the SDK's helper: needs response.completed
    assert streamed.status == "completed" and streamed.output_text
    structured = client.responses.parse(model=MODEL, input="Invent a person from Rome.", text_format=Person,
                                        max_output_tokens=200, temperature=0)
    assert isinstance(structured.output_parsed, Person)
    chat = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2)
    with sqlite3.connect(tollway.home / "tollway.db") as db:
        rows = dict(db.execute("SELECT request_id, route FROM usage_events").fetchall())
        usage = db.execute("SELECT prompt_tokens, completion_tokens FROM usage_events WHERE request_id = ?",
                           (plain.id,)).fetchone()
    assert rows[plain.id] == rows[final.id] == rows[streamed.id] == rows[structured.id] == "responses"
    assert rows[chat.id] == "chat.completions"
    assert usage == (plain.usage.input_tokens, plain.usage.output_tokens)


def test_responses_function_tools(client: openai.OpenAI) -> None:
    tool = {"type": "function", **WEATHER["function"]}
    response = client.responses.create(model=MODEL, input=ASK_WEATHER[0]["content"], tools=[tool],
                                       tool_choice="required", max_output_tokens=120, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}}, "tool_choice"),
    ({"messages": [*ASK_WEATHER, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK_WEATHER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_structure_is_a_400(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    request = {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 5, **kwargs}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**request)
    assert error.value.status_code == 400 and error.value.body["param"] == param  # type: ignore[index]


def test_a_schema_the_grammar_compiler_refuses_is_a_400_too(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}  # valid JSON Schema, dangling ref
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "dangling", "schema": schema}})
    # Our prefix, then xgrammar's own reason (its wording moved between releases: 0.2.9 quotes the field's name).
    message = str(error.value)
    assert error.value.status_code == 400 and "cannot be used for constrained decoding: Cannot find field" in message
    assert "$defs" in message.split("constrained decoding:", 1)[1]
