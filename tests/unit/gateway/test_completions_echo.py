"""`echo` on /v1/completions through the real gateway app, against a fake worker (its character
tokenizer makes every prompt character one token; its prompt logprobs are -0.25 each): the prompt
opens the text and the logprobs, max_tokens 0 gives the prompt alone and is billed as a prompt,
streamed echo equals the joined answer, and the combinations it does not serve are 400s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytest_asyncio

from ops.fake_worker import FakeWorker, create_fake_worker_app
from tests.unit.gateway.test_gateway_api import MODEL, make_tenant_key, sse_events, start_gateway
from tests.unit.gateway.test_gateway_metering import usage_rows

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def setup(aiohttp_client, aiohttp_server, tmp_path: Path):
    """(client, auth headers, the fake worker)."""
    worker = FakeWorker(context_length=256)
    server = await aiohttp_server(create_fake_worker_app(worker))
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db")
    client = await start_gateway(aiohttp_client, tmp_path, [str(server.make_url("")).rstrip("/")])
    return client, {"Authorization": f"Bearer {key}"}, worker


async def complete(setup, **fields) -> dict:
    client, auth, _ = setup
    response = await client.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": "abc", **fields})
    assert response.status == 200, await response.text()
    return await response.json()


async def test_echo_with_max_tokens_zero_gives_the_prompt_and_its_logprobs(setup, tmp_path: Path) -> None:
    _, _, worker = setup
    body = await complete(setup, echo=True, logprobs=2, max_tokens=0)
    assert worker.requests[-1]["sampling"]["max_tokens"] == 0
    assert worker.requests[-1]["sampling"]["prompt_logprobs"] == 2
    [choice] = body["choices"]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"] and logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["token_logprobs"] == [None, -0.25, -0.25]
    assert logprobs["top_logprobs"] == [None, {"b": -0.25, "c": -1.25}, {"c": -0.25, "d": -1.25}]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 0
    [row] = usage_rows(tmp_path)  # billed like any prompt: 3 prompt tokens, no completion
    assert (row.prompt_tokens, row.completion_tokens, row.status, row.finish_reason) == (3, 0, "ok", "length")


async def test_echo_puts_the_prompt_before_the_completion_and_its_logprobs(setup) -> None:
    plain = await complete(setup, logprobs=1, max_tokens=2)
    echoed = await complete(setup, echo=True, logprobs=1, max_tokens=2)
    completion = plain["choices"][0]
    choice = echoed["choices"][0]
    assert choice["text"] == "abc" + completion["text"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c", *completion["logprobs"]["tokens"]]
    assert logprobs["token_logprobs"] == [None, -0.25, -0.25, *completion["logprobs"]["token_logprobs"]]
    assert logprobs["top_logprobs"][3:] == completion["logprobs"]["top_logprobs"]
    # the generated tokens' offsets go on after the prompt's text
    assert logprobs["text_offset"] == [0, 1, 2, *(3 + o for o in completion["logprobs"]["text_offset"])]


async def test_echo_without_logprobs_and_of_token_ids(setup) -> None:
    _, _, worker = setup
    body = await complete(setup, echo=True, max_tokens=1)
    assert body["choices"][0]["text"] == "abc tok0" and body["choices"][0]["logprobs"] is None
    assert "prompt_logprobs" not in worker.requests[-1]["sampling"]  # nothing to recompute for
    ids = worker.requests[-1]["prompt_token_ids"]
    by_ids = await complete(setup, prompt=ids, echo=True, max_tokens=0)
    assert by_ids["choices"][0]["text"] == "abc"  # token ids are echoed decoded


async def test_echo_with_n_choices_opens_each_one(setup) -> None:
    body = await complete(setup, echo=True, logprobs=0, max_tokens=2, n=2)
    assert [c["text"] for c in body["choices"]] == ["abc tok0 tok1"] * 2
    assert all(c["logprobs"]["token_logprobs"][:3] == [None, -0.25, -0.25] for c in body["choices"])


async def test_streamed_echo_sends_the_prompt_first_and_equals_the_joined_answer(setup) -> None:
    client, auth, _ = setup
    joined = await complete(setup, echo=True, logprobs=1, max_tokens=3)
    response = await client.post("/v1/completions", headers=auth, json={
        "model": MODEL, "prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status == 200
    events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["text"] == "abc" and choices[0]["logprobs"]["token_logprobs"] == [None, -0.25, -0.25]
    assert "".join(c["text"] for c in choices) == joined["choices"][0]["text"]
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for choice in choices:
        for key in merged:
            merged[key] += choice["logprobs"][key] if choice["logprobs"] else []
    assert merged == joined["choices"][0]["logprobs"]
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_streamed_echo_of_the_prompt_alone(setup) -> None:
    client, auth, _ = setup
    response = await client.post("/v1/completions", headers=auth, json={
        "model": MODEL, "prompt": "abc", "echo": True, "logprobs": 0, "max_tokens": 0, "stream": True})
    chunks = [json.loads(e) for e in sse_events(await response.text())[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["abc", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": 0}, "max_tokens"),  # the prompt alone is only an echo
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"max_tokens": 0, "echo": True, "n": 2}, "n"),
    ({"echo": True, "n": 2, "stream": True}, "echo"),
    ({"echo": "yes"}, "echo"),
    ({"echo": True, "logprobs": 6}, "logprobs"),
])
async def test_unservable_echo_requests_are_400s(setup, fields: dict, param: str) -> None:
    client, auth, worker = setup
    before = len(worker.requests)
    response = await client.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": "abc", **fields})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert len(worker.requests) == before  # refused before reaching a worker


async def test_chat_still_needs_a_token(setup) -> None:
    client, auth, _ = setup
    response = await client.post("/v1/chat/completions", headers=auth, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert response.status == 400 and (await response.json())["error"]["param"] == "max_tokens"
