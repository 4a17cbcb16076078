"""The fake worker (a test double) speaks the real worker's protocol: checked side by side."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from ops.fake_worker import FAKE_WORKER_KEY, FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel
from workers.server.app import create_worker_app

PROMPT = list(range(5, 45))
pytestmark = pytest.mark.asyncio
AUTH = {"Authorization": f"Bearer {FAKE_WORKER_SECRET}"}  # the gateway's credential, on every call


@pytest_asyncio.fixture
async def real(tiny: LoadedModel, aiohttp_client):
    engine = AsyncEngine(Engine(tiny, EngineConfig(num_blocks=64, block_size=8), name="tiny"))
    yield await aiohttp_client(create_worker_app(engine, secret=FAKE_WORKER_SECRET), headers=AUTH)
    engine.shutdown()


@pytest_asyncio.fixture
async def fake(tiny: LoadedModel, aiohttp_client):
    """A fake with the tiny model's limits, so validation messages can be compared verbatim."""
    worker = FakeWorker(model="tiny", context_length=512, vocab_size=tiny.model.config.vocab_size)
    return await aiohttp_client(create_fake_worker_app(worker), headers=AUTH), worker


def body(request_id: str = "r1", **sampling) -> dict:
    sampling = {"max_tokens": 4, "temperature": 0.7, "seed": 3, "ignore_eos": True, **sampling}
    return {"request_id": request_id, "namespace": "tenant-a", "prompt_token_ids": PROMPT, "sampling": sampling}


async def read_stream(response: aiohttp.ClientResponse) -> list[dict]:
    return [json.loads(line) for line in (await response.text()).splitlines()]


def shape(value: Any) -> Any:
    """Keys, types and nesting, without the values a model decides."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


@pytest.mark.parametrize("sampling", [{}, {"n": 2}, {"logprobs": 2}, {"logprobs": 0, "n": 3}])
async def test_stream_shape_matches_the_real_worker(real, fake, sampling: dict) -> None:
    real_response = await real.post("/internal/generate", json=body(**sampling))
    fake_response = await fake[0].post("/internal/generate", json=body(**sampling))
    assert real_response.status == fake_response.status == 200
    assert real_response.content_type == fake_response.content_type == "application/x-ndjson"
    real_lines, fake_lines = await read_stream(real_response), await read_stream(fake_response)
    assert [shape(line) for line in fake_lines] == [shape(line) for line in real_lines]
    for key in ("index", "finish_reason"):
        assert [line[key] for line in fake_lines] == [line[key] for line in real_lines]
    real_usage, fake_usage = real_lines[-1]["usage"], fake_lines[-1]["usage"]
    assert fake_usage == {**real_usage, "cached_tokens": 0}


@pytest.mark.parametrize("sampling", [{}, {"n": 2}, {"logprobs": 2, "n": 2}])
async def test_joined_answer_shape_matches_the_real_worker(real, fake, sampling: dict) -> None:
    joined = {**body(**sampling), "stream": False}
    real_lines = await read_stream(await real.post("/internal/generate", json=joined))
    fake_lines = await read_stream(await fake[0].post("/internal/generate", json=joined))
    assert [shape(line) for line in fake_lines] == [shape(line) for line in real_lines]
    assert len(real_lines) == sampling.get("n", 1)  # one joined line per choice
    for key in ("finish_reason",):
        assert [line[key] for line in fake_lines] == [line[key] for line in real_lines]
    assert all(len(line["token_ids"]) == 4 and line["decode_s"] >= 0 for line in real_lines + fake_lines)
    assert "usage" in real_lines[-1] and "usage" in fake_lines[-1]


async def test_canned_tokens_and_usage(aiohttp_client) -> None:
    worker = FakeWorker(cached_tokens=lambda namespace, prompt: len(prompt) // 2)
    client = await aiohttp_client(create_fake_worker_app(worker), headers=AUTH)
    request = {"request_id": "a", "namespace": "t", "prompt_token_ids": [1, 2, 3, 4]}
    lines = await read_stream(await client.post("/internal/generate", json=request))  # default max_tokens 16
    assert [line["token_ids"] for line in lines] == [[i] for i in range(16)]
    assert "".join(line["text"] for line in lines) == "".join(f" tok{i}" for i in range(16))
    assert [line["finish_reason"] for line in lines] == [None] * 15 + ["length"]
    assert lines[-1]["usage"] == {"prompt_tokens": 4, "cached_tokens": 2, "completion_tokens": 16}
    assert all("usage" not in line for line in lines[:-1])
    assert worker.requests == [request]
    # The context bounds the completion, as on the real worker.
    short = FakeWorker(context_length=10)
    client = await aiohttp_client(create_fake_worker_app(short), headers=AUTH)
    lines = await read_stream(await client.post("/internal/generate", json={**request, "request_id": "b"}))
    assert len(lines) == 6 and lines[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    "payload",
    [
        "not json",
        [1, 2],
        {"namespace": "a", "prompt_token_ids": [1]},
        {**body(), "namespace": ""},
        {**body(), "prompt_token_ids": "hello"},
        {**body(), "prompt_token_ids": [True]},
        {**body(), "prompt_token_ids": []},
        {**body(), "prompt_token_ids": [1, 10**9]},
        {**body(), "prompt_token_ids": list(range(1, 60)) * 10},
        {**body(), "priority": "urgent"},
        {**body(), "sampling": "hot"},
        body(top_p=0),
        body(colour="blue"),
        body(max_tokens="many"),
        body(stop=7),
        body(seed=1.5),
        body(n=17),
    ],
)
async def test_bad_input_answers_exactly_as_the_real_worker(real, fake, payload) -> None:
    kwargs = {"data": payload} if isinstance(payload, str) else {"json": payload}
    real_response = await real.post("/internal/generate", **kwargs)
    fake_response = await fake[0].post("/internal/generate", **kwargs)
    assert real_response.status == fake_response.status == 400
    assert await fake_response.json() == await real_response.json()


def metric_names(text: str) -> set[tuple[str, str]]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(family.name, family.type) for family in text_string_to_metric_families(text)}


async def test_info_health_metrics_and_tokenizer_routes_match(real, fake) -> None:
    client, _ = fake
    await read_stream(await client.post("/internal/generate", json=body()))
    await read_stream(await real.post("/internal/generate", json=body()))
    real_info = await (await real.get("/internal/info")).json()
    fake_info = await (await client.get("/internal/info")).json()
    assert set(fake_info) - {"fake"} == set(real_info)  # plus the double's own counters
    assert fake_info["fake"] == {"max_running": 1, "requests": 1}
    assert set(fake_info["blocks"]) == set(real_info["blocks"])
    assert set(fake_info["cache"]["tenant-a"]) == set(real_info["cache"]["tenant-a"])
    assert fake_info["finished"] == {"length": 1} and fake_info["model"] == "tiny"
    assert await (await client.get("/healthz")).json() == await (await real.get("/healthz")).json()
    metrics = await (await client.get("/metrics")).text()
    assert "tollway_worker_completion_tokens_total 4.0" in metrics
    real_metrics = await (await real.get("/metrics")).text()
    assert metric_names(metrics) == metric_names(real_metrics)  # the same series, by name and type
    real_payload = await (await real.get("/internal/tokenizer")).json()
    fake_payload = await (await client.get("/internal/tokenizer")).json()
    assert set(fake_payload) == set(real_payload) and fake_payload["model"] == "tiny"


async def test_tokenizer_payload_works_in_the_gateway(aiohttp_client) -> None:
    from workers.wire.tokenizer import TextTokenizer

    client = await aiohttp_client(create_fake_worker_app(), headers=AUTH)
    payload = await (await client.get("/internal/tokenizer")).json()
    assert payload["model"] == "smollm2-135m-instruct"
    tokenizer = TextTokenizer.from_payload(payload)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.render_chat(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.render_chat(messages, add_generation_prompt=False).endswith("Hi!<|im_end|>\n")
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|>, <|im_end|> are single tokens
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(tokenizer.encode("Hello, world!")) == "Hello, world!"


async def test_unhealthy_flag_makes_healthz_503(fake) -> None:
    client, worker = fake
    worker.healthy = False
    response = await client.get("/healthz")
    assert response.status == 503 and (await response.json())["status"] == "unhealthy"
    worker.healthy = True
    assert (await client.get("/healthz")).status == 200
    assert client.app[FAKE_WORKER_KEY] is worker


async def test_fail_after_tokens_drops_the_connection_mid_stream(fake) -> None:
    client, worker = fake
    worker.fail_after_tokens = 2
    response = await client.post("/internal/generate", json=body(max_tokens=8))
    assert response.status == 200
    lines = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async for raw in response.content:
            lines.append(json.loads(raw))
    assert len(lines) == 2 and all("usage" not in line for line in lines)
    assert worker.running == set() and worker.finished == {}
    worker.fail_after_tokens = None
    lines = await read_stream(await client.post("/internal/generate", json=body("again", max_tokens=8)))
    assert lines[-1]["finish_reason"] == "length"  # the worker itself keeps serving


async def test_delay_streams_slowly_and_a_running_id_is_a_400(fake) -> None:
    client, worker = fake
    worker.delay_s = 0.02
    slow = await client.post("/internal/generate", json=body("dup", max_tokens=5))
    first = json.loads(await slow.content.readline())
    assert first["token_ids"] == [0] and worker.running == {"dup"}
    clash = await client.post("/internal/generate", json=body("dup"))
    assert clash.status == 400
    assert (await clash.json())["error"]["message"] == "request id 'dup' is already running"
    slow.close()  # the gateway hung up
    for _ in range(100):
        if not worker.running:
            break
        await asyncio.sleep(0.01)
    assert worker.running == set() and worker.finished == {}


async def test_both_refuse_internal_calls_without_the_gateways_credential(real, fake) -> None:
    """The same door (workers/server/auth.py): 401 with the same body on every /internal/* route
    and on the channel's upgrade, without the bearer or with another; /healthz and /metrics open."""
    calls = [("POST", "/internal/generate"), ("GET", "/internal/channel"), ("GET", "/internal/info"),
             ("GET", "/internal/tokenizer"), ("GET", "/internal/traces"), ("POST", "/internal/requests/r/cancel")]
    for client in (real, fake[0]):
        async with aiohttp.ClientSession() as bare:  # no default headers
            for method, path in calls:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": FAKE_WORKER_SECRET}):
                    async with bare.request(method, client.make_url(path), headers=headers,
                                            json=body()) as response:
                        assert response.status == 401, (method, path, headers)
                        error = (await response.json())["error"]
                        assert error["type"] == "authentication_error" and "credential" in error["message"]
            for path in ("/healthz", "/metrics"):
                async with bare.get(client.make_url(path)) as response:
                    assert response.status == 200, path
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await bare.ws_connect(client.make_url("/internal/channel"))
            assert refused.value.status == 401
    assert fake[1].received == 0  # nothing reached the double's handlers
