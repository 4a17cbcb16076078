"""`POST /v1/responses` through the real gateway app against a fake worker: the request is read as
the chat request it amounts to, answered in the Responses shape (object and event stream), metered
with route `responses` beside chat's `chat.completions`; bad bodies are 400s naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytest_asyncio

from gateway.openai.responses_api import ResponsesBuilder, parse_responses
from ops.fake_worker import FakeWorker
from tests.unit.gateway.test_gateway_api import MODEL, chat
from tests.unit.gateway.test_gateway_metering import gateway_for, usage_rows

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def setup(aiohttp_client, aiohttp_server, tmp_path: Path):
    worker = FakeWorker(cached_tokens=lambda namespace, prompt: 2)
    client, auth, _ = await gateway_for(aiohttp_client, aiohttp_server, tmp_path, worker)
    return client, auth, worker, tmp_path


def events(text: str) -> list[tuple[str, dict]]:
    parsed = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        parsed.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return parsed


async def test_plain_and_streamed_responses_are_metered_with_their_route(setup) -> None:
    client, auth, worker, tmp_path = setup
    response = await client.post("/v1/responses", headers=auth, json={
        "model": MODEL, "instructions": "Be brief.", "input": "hi", "max_output_tokens": 3, "store": False})
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} and body["instructions"] == "Be brief."
    [message] = body["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == " tok0 tok1 tok2"
    assert body["usage"]["output_tokens"] == 3 and body["usage"]["input_tokens_details"]["cached_tokens"] == 2
    assert worker.requests[-1]["sampling"]["max_tokens"] == 3

    streamed = await client.post("/v1/responses", headers=auth, json={
        "model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "max_output_tokens": 2, "stream": True})
    seen = events(await streamed.text())
    names = [name for name, _ in seen]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e["delta"] for n, e in seen if n == "response.output_text.delta") == " tok0 tok1"
    assert [e["sequence_number"] for _, e in seen] == list(range(len(seen)))
    final = seen[-1][1]["response"]
    assert final["usage"]["output_tokens"] == 2
    await client.post("/v1/chat/completions", headers=auth, json=chat())
    routes = {row.request_id: row.route for row in usage_rows(tmp_path)}
    assert routes[body["id"]] == routes[final["id"]] == "responses"
    assert sorted(routes.values()) == ["chat.completions", "responses", "responses"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "1"}]}, "input[1].call_id"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 1}}}},
     "text.format.schema"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input[0].call_id"),
    ({"input": "hi", "n": 2}, "n"),
])
async def test_bad_bodies_are_400s_naming_the_field(setup, body: dict, param: str) -> None:
    client, auth, worker, _ = setup
    before = len(worker.requests)
    response = await client.post("/v1/responses", headers=auth, json={"model": MODEL, **body})
    assert response.status == 400, await response.text()
    assert (await response.json())["error"]["param"] == param
    assert len(worker.requests) == before


@pytest.mark.parametrize(("body", "says"), [
    ({"input": "hi", "max_output_tokens": 0}, "'max_output_tokens' must be at least 1"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "earlier function_call"),
])
async def test_refusals_speak_the_responses_api_s_names(setup, body: dict, says: str) -> None:
    client, auth, _, _ = setup
    response = await client.post("/v1/responses", headers=auth, json={"model": MODEL, **body})
    assert response.status == 400
    assert says in (await response.json())["error"]["message"]


async def test_function_call_items_and_their_outputs_become_a_chat_conversation() -> None:
    request = parse_responses({"model": MODEL, "input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
    ], "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": "required"})
    assert [m["role"] for m in request.messages or []] == ["user", "assistant", "tool"]
    assert request.grammar is not None and request.grammar.at_least_one
    fmt = parse_responses({"model": MODEL, "input": "x", "text": {"format": {"type": "json_object"}}})
    assert fmt.grammar is not None and fmt.grammar.kind == "json_object"


async def test_streamed_function_calls_get_their_argument_events() -> None:
    builder = ResponsesBuilder("resp_1", MODEL, 0, {}, tools=True)
    out = builder.stream_start() + builder.stream_line({"index": 0, "text": '<tool_call>\n{"name": "f", "arguments": '
                                                        '{"a": 1}}\n</tool_call>', "finish_reason": "stop"})
    out += builder.stream_end({"prompt_tokens": 4, "completion_tokens": 9}, False)
    seen = events(out.decode())
    names = [name for name, _ in seen]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    [call] = seen[-1][1]["response"]["output"]
    assert call["type"] == "function_call" and call["name"] == "f" and json.loads(call["arguments"]) == {"a": 1}
