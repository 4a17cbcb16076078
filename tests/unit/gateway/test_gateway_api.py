"""The gateway's OpenAI and admin routes, from the real app factory, against fake workers.

The workers here are `ops.fake_worker` test doubles (canned tokens, a tiny character tokenizer):
these tests cover the gateway's own logic: auth, validation, tokenization, streaming, retries.
The real model behind a real gateway is covered in tests/e2e.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytest_asyncio

from accounting.api_keys import create_key
from accounting.db import create_db_engine, session_factory, upgrade_database
from accounting.tenants import create_tenant
from gateway.api.openapi import BROWSER_PAGES
from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.state import POOL, ROUTER
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app

pytestmark = pytest.mark.asyncio
ADMIN = {"Authorization": "Bearer test-admin-key"}
MODEL = "smollm2-135m-instruct"


def make_tenant_key(url: str, name: str = "acme", **quotas: int) -> tuple[int, str]:
    engine = create_db_engine(url)
    upgrade_database(engine)
    with session_factory(engine)() as session, session.begin():
        tenant = create_tenant(session, name, **quotas)
        _, key = create_key(session, name)
        tenant_id = tenant.id
    engine.dispose()
    return tenant_id, key


async def start_gateway(aiohttp_client, tmp_path: Path, worker_urls: list[str], **overrides):
    settings = GatewaySettings(home=tmp_path, worker_urls=",".join(worker_urls), admin_key="test-admin-key",
                               worker_secret=FAKE_WORKER_SECRET,
                               health_interval_s=0.2, **overrides)
    return await aiohttp_client(create_app(settings))


@pytest_asyncio.fixture
async def setup(aiohttp_client, aiohttp_server, tmp_path: Path):
    """(client, auth headers, the fake worker, tenant id)."""
    worker = FakeWorker(context_length=256)
    server = await aiohttp_server(create_fake_worker_app(worker))
    tenant_id, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db")
    client = await start_gateway(aiohttp_client, tmp_path, [str(server.make_url("")).rstrip("/")])
    return client, {"Authorization": f"Bearer {key}"}, worker, tenant_id


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


def sse_events(text: str) -> list[str]:
    return [block.removeprefix("data: ") for block in text.split("\n\n") if block.strip()]


async def test_models_need_a_valid_key(setup) -> None:
    client, auth, _, _ = setup
    response = await client.get("/v1/models", headers=auth)
    assert response.status == 200
    assert [m["id"] for m in (await response.json())["data"]] == [MODEL]
    for headers in ({}, {"Authorization": "Bearer tw-not-a-real-key"}):
        response = await client.get("/v1/models", headers=headers)
        assert response.status == 401
        error = (await response.json())["error"]
        assert error["type"] == "authentication_error" and set(error) == {"message", "type", "param", "code"}


async def test_chat_completion_tokenizes_routes_and_answers(setup) -> None:
    client, auth, worker, tenant_id = setup
    response = await client.post("/v1/chat/completions", headers=auth, json=chat(namespace="someone-else"))
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " tok0 tok1 tok2"}
    assert body["choices"][0]["finish_reason"] == "length"
    sent = worker.requests[-1]
    assert sent["stream"] is False  # the joined answer: nothing to forward before the end
    assert sent["namespace"] == f"tenant-{tenant_id}"  # from the key, never from the client
    assert sent["sampling"]["max_tokens"] == 3
    prompt_text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert len(sent["prompt_token_ids"]) == 2 + len("user\nhi") + 1 + 1 + len("assistant\n")
    assert body["usage"] == {"prompt_tokens": len(sent["prompt_token_ids"]), "completion_tokens": 3,
                             "total_tokens": len(sent["prompt_token_ids"]) + 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert prompt_text.count("<|im_start|>") == 2


async def test_streamed_chat_ends_with_usage_then_done(setup) -> None:
    client, auth, worker, _ = setup
    response = await client.post("/v1/chat/completions", headers=auth,
                                 json=chat(stream=True, stream_options={"include_usage": True}))
    assert worker.requests[-1]["stream"] is True
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == " tok0 tok1 tok2"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_stream_without_include_usage_has_no_usage_chunk(setup) -> None:
    client, auth, _, _ = setup
    response = await client.post("/v1/chat/completions", headers=auth, json=chat(stream=True))
    chunks = [json.loads(e) for e in sse_events(await response.text())[:-1]]
    assert all("usage" not in c for c in chunks)


async def test_completions_take_text_or_token_ids(setup) -> None:
    client, auth, worker, _ = setup
    for prompt in ("abc", [5, 6, 7]):
        response = await client.post("/v1/completions", headers=auth,
                                     json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "n": 2})
        assert response.status == 200, await response.text()
        body = await response.json()
        assert body["object"] == "text_completion"
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert all(c["text"] == " tok0 tok1" for c in body["choices"])
        assert len(worker.requests[-1]["prompt_token_ids"]) == 3


async def test_non_streamed_logprobs_keep_the_per_token_lines(setup) -> None:
    client, auth, worker, _ = setup
    response = await client.post("/v1/completions", headers=auth,
                                 json={"model": MODEL, "prompt": "abc", "max_tokens": 3, "logprobs": 1})
    assert response.status == 200, await response.text()
    assert worker.requests[-1]["stream"] is True  # their texts set text_offset as when streamed
    logprobs = (await response.json())["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == [0, 5, 10] and len(logprobs["token_logprobs"]) == 3


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, "response_format.json_schema.schema"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "call_1"}]}, "messages[0].tool_call_id"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"model": None}, "model"),
])
async def test_bad_parameters_are_400s_naming_the_parameter(setup, fields: dict, param: str) -> None:
    client, auth, worker, _ = setup
    before = len(worker.requests)
    response = await client.post("/v1/chat/completions", headers=auth, json=chat(**fields))
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert len(worker.requests) == before  # refused before reaching a worker


@pytest.mark.parametrize(("fields", "says"), [
    ({"model": 5}, "'model' must be a non-empty string"),
    ({"seed": 2**70}, "'seed' must be an integer between"),  # beyond 64 bits: JSON's parser hands over a float
    ({"seed": 1.5}, "'seed' must be an integer between"),
])
async def test_a_refusal_says_what_was_wrong_with_the_value(setup, fields: dict, says: str) -> None:
    client, auth, _, _ = setup
    response = await client.post("/v1/chat/completions", headers=auth, json=chat(**fields))
    assert response.status == 400
    assert says in (await response.json())["error"]["message"]


async def test_client_errors_never_become_500s(setup) -> None:
    client, auth, _, _ = setup
    cases = [
        (await client.post("/v1/chat/completions", headers=auth, data=b"{not json"), 400),
        (await client.post("/v1/chat/completions", headers=auth, data=b"[1, 2]"), 400),
        (await client.post("/v1/chat/completions", headers=auth, json=chat(model="gpt-9")), 404),
        (await client.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": [10**9]}), 400),
        (await client.post("/v1/chat/completions", headers=auth, data=b"x" * (5 * 2**20)), 413),
        (await client.get("/v1/nothing-here", headers=auth), 404),
        (await client.get("/v1/models/gpt-9", headers=auth), 404),
    ]
    for response, status in cases:
        assert response.status == status, await response.text()
        assert set((await response.json())["error"]) == {"message", "type", "param", "code"}


async def test_a_prompt_longer_than_the_context_is_a_400_with_the_numbers(setup) -> None:
    client, auth, _, _ = setup
    response = await client.post("/v1/completions", headers=auth,
                                 json={"model": MODEL, "prompt": "x" * 300, "max_tokens": 10})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "256" in error["message"] and "310" in error["message"] and "300" in error["message"]


async def test_without_max_tokens_the_completion_may_fill_the_context(setup) -> None:
    client, auth, worker, _ = setup
    await client.post("/v1/completions", headers=auth, json={"model": MODEL, "prompt": "x" * 200})
    assert worker.requests[-1]["sampling"]["max_tokens"] == 56


async def test_openapi_describes_every_route(setup) -> None:
    client, _, _, _ = setup
    spec = await (await client.get("/openapi.json")).json()
    for route in client.app.router.routes():
        path = route.resource.canonical
        if route.method == "HEAD":
            continue
        if path.startswith(BROWSER_PAGES):  # the HTML dashboard is for people, not the JSON API
            assert path not in spec["paths"]
        else:
            assert route.method.lower() in spec["paths"][path]
    assert any(r.resource.canonical.startswith(BROWSER_PAGES) for r in client.app.router.routes())
    assert spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert (await (await client.get("/healthz")).json())["workers_healthy"] == 1


async def test_an_unstarted_request_is_retried_on_another_worker(aiohttp_client, aiohttp_server, tmp_path) -> None:
    broken, good = FakeWorker(fail_after_tokens=0), FakeWorker()
    urls = [str((await aiohttp_server(create_fake_worker_app(w))).make_url("")).rstrip("/") for w in (broken, good)]
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db")
    client = await start_gateway(aiohttp_client, tmp_path, urls)
    auth = {"Authorization": f"Bearer {key}"}
    for _ in range(4):
        response = await client.post("/v1/chat/completions", headers=auth, json=chat())
        assert response.status == 200, await response.text()
    assert len(good.requests) == 4 and len(broken.requests) <= 1  # out of rotation after its first failure


async def test_a_stream_that_breaks_midway_ends_with_an_error_event(aiohttp_client, aiohttp_server, tmp_path) -> None:
    worker = FakeWorker(fail_after_tokens=2)
    url = str((await aiohttp_server(create_fake_worker_app(worker))).make_url("")).rstrip("/")
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db")
    client = await start_gateway(aiohttp_client, tmp_path, [url])
    auth = {"Authorization": f"Bearer {key}"}
    response = await client.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=8, stream=True))
    events = sse_events(await response.text())
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "worker_failed"


async def test_a_non_streamed_request_survives_a_worker_lost_midway(aiohttp_client, aiohttp_server, tmp_path) -> None:
    dying, good = FakeWorker(fail_after_tokens=2), FakeWorker()
    urls = [str((await aiohttp_server(create_fake_worker_app(w))).make_url("")).rstrip("/") for w in (dying, good)]
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db")
    client = await start_gateway(aiohttp_client, tmp_path, urls)
    # Route to the dying worker whenever it is in rotation, so each request meets the failure first.
    client.app[ROUTER].choose = lambda namespace, ids, loads: urls[0] if urls[0] in loads else next(iter(loads))
    auth = {"Authorization": f"Bearer {key}"}
    for _ in range(3):
        await client.app[POOL].poll_all()  # both in rotation
        response = await client.post("/v1/chat/completions", headers=auth, json=chat(max_tokens=8))
        assert response.status == 200, await response.text()
        assert (await response.json())["choices"][0]["message"]["content"].count("tok") == 8
    assert len(dying.requests) == 3 and len(good.requests) == 3


async def test_admin_manages_tenants_and_keys_and_revocation_is_immediate(setup) -> None:
    client, _, _, _ = setup
    assert (await client.get("/admin/v1/tenants")).status == 401
    response = await client.post("/admin/v1/tenants", headers=ADMIN, json={"name": "beta", "rpm": 10})
    assert response.status == 201 and (await response.json())["rpm"] == 10
    assert (await client.post("/admin/v1/tenants", headers=ADMIN, json={"name": "beta"})).status == 409
    assert (await client.post("/admin/v1/tenants", headers=ADMIN, json={"name": "bad name!"})).status == 400
    created = await (await client.post("/admin/v1/keys", headers=ADMIN, json={"tenant": "beta"})).json()
    key = created["key"]
    auth = {"Authorization": f"Bearer {key}"}
    assert (await client.get("/v1/models", headers=auth)).status == 200
    listed = await (await client.get("/admin/v1/keys?tenant=beta", headers=ADMIN)).json()
    assert key not in json.dumps(listed) and listed["data"][0]["prefix"] == key[:10]
    assert (await client.post(f"/admin/v1/keys/{created['id']}/revoke", headers=ADMIN)).status == 200
    assert (await client.get("/v1/models", headers=auth)).status == 401  # cached a moment ago, refused now

    other = await (await client.post("/admin/v1/keys", headers=ADMIN, json={"tenant": "beta"})).json()
    rotated = await (await client.post(f"/admin/v1/keys/{other['id']}/rotate", headers=ADMIN,
                                       json={"grace_seconds": 0})).json()
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {rotated['key']}"})).status == 200
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {other['key']}"})).status == 401

    disabled = await client.patch("/admin/v1/tenants/beta", headers=ADMIN, json={"disabled": True})
    assert disabled.status == 200
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {rotated['key']}"})).status == 401
    assert (await client.get("/admin/v1/tenants/nobody", headers=ADMIN)).status == 404


@pytest.mark.parametrize(("method", "path", "body", "param"), [
    ("post", "/admin/v1/tenants", {"name": "bad name!"}, "name"),
    ("post", "/admin/v1/tenants", {"name": "gamma", "tpm": -1}, "tpm"),
    ("patch", "/admin/v1/tenants/acme", {"rpm": -3}, "rpm"),
    ("patch", "/admin/v1/tenants/acme", {"max_concurrent": "2"}, "max_concurrent"),
    ("post", "/admin/v1/keys/1/rotate", {"grace_seconds": -1}, "grace_seconds"),
])
async def test_admin_refusals_name_the_field(setup, method: str, path: str, body: dict, param: str) -> None:
    client, _, _, _ = setup
    response = await getattr(client, method)(path, headers=ADMIN, json=body)
    assert response.status == 400, await response.text()
    assert (await response.json())["error"]["param"] == param



async def test_structured_requests_send_their_grammar_to_the_worker(setup) -> None:
    client, auth, worker, _ = setup
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    response = await client.post("/v1/chat/completions", headers=auth, json=chat(
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}))
    assert response.status == 200, await response.text()
    assert worker.requests[-1]["grammar"] == {"type": "json_schema", "schema": json.dumps(schema, separators=(",", ":"))}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    response = await client.post("/v1/chat/completions", headers=auth, json=chat(
        tools=tools, tool_choice="required", parallel_tool_calls=False))
    assert response.status == 200, await response.text()
    grammar = worker.requests[-1]["grammar"]
    assert grammar["type"] == "tool_tags" and grammar["at_least_one"] and grammar["stop_after_first"]
    assert grammar["tags"][0]["begin"] == '<tool_call>\n{"name": "f", "arguments": '
    plain = await client.post("/v1/chat/completions", headers=auth, json=chat(tools=tools, tool_choice="none"))
    assert plain.status == 200 and "grammar" not in worker.requests[-1]


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_router_chooses_only_among_several_workers(aiohttp_client, aiohttp_server, tmp_path, workers) -> None:
    urls = [str((await aiohttp_server(create_fake_worker_app(FakeWorker()))).make_url("")).rstrip("/")
            for _ in range(workers)]
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db")
    client = await start_gateway(aiohttp_client, tmp_path, urls)
    choices: list[str] = []
    choose = client.app[ROUTER].choose
    client.app[ROUTER].choose = lambda namespace, ids, loads: choices.append(choose(namespace, ids, loads)) or choices[-1]
    response = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                 json=chat(max_tokens=4))
    assert response.status == 200, await response.text()
    assert len(choices) == (0 if workers == 1 else 1)  # one worker: no choice, no prefix index to keep
