"""The worker's internal HTTP API over a real aiohttp server, on a tiny random-weight model."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel
from workers.wire.sampling import SamplingParams

PROMPT = list(range(5, 45))
pytestmark = pytest.mark.asyncio


def body(request_id: str = "r1", **sampling) -> dict:
    sampling = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **sampling}
    return {"request_id": request_id, "namespace": "tenant-a", "prompt_token_ids": PROMPT, "sampling": sampling}


async def read_stream(response: aiohttp.ClientResponse) -> list[dict]:
    return [json.loads(line) for line in (await response.text()).splitlines()]


async def test_generate_needs_the_gateways_credential(worker) -> None:
    """Only a caller holding the workers' secret (the gateway) runs requests, and so picks namespaces."""
    client, engine = worker
    async with aiohttp.ClientSession() as bare:
        for headers in ({}, {"Authorization": "Bearer not-the-secret"}):
            response = await bare.post(client.make_url("/internal/generate"), json=body("stranger"), headers=headers)
            assert response.status == 401 and (await response.json())["error"]["type"] == "authentication_error"
        assert (await bare.get(client.make_url("/healthz"))).status == 200
    assert engine.info()["cache"] == {}  # nothing ran: no namespace was ever created
    response = await client.post("/internal/generate", json=body("gateway"))  # the client sends the secret
    assert response.status == 200 and "usage" in (await read_stream(response))[-1]
    assert set(engine.info()["cache"]) == {"tenant-a"}


async def test_generate_streams_deltas_then_usage(worker, tiny) -> None:
    client, _ = worker
    expected = Engine(tiny, EngineConfig(num_blocks=64, block_size=8)).generate_batch(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].output_ids
    response = await client.post("/internal/generate", json=body())
    assert response.status == 200 and response.content_type == "application/x-ndjson"
    lines = await read_stream(response)
    assert [t for line in lines for t in line["token_ids"]] == expected
    assert [line["finish_reason"] for line in lines] == [None] * (len(lines) - 1) + ["length"]
    assert lines[-1]["usage"] == {"prompt_tokens": len(PROMPT), "cached_tokens": 0, "completion_tokens": 8}
    again = await read_stream(await client.post("/internal/generate", json=body("r2")))
    assert again[-1]["usage"]["cached_tokens"] == len(PROMPT) - 1  # all but the last token, which is always computed


async def test_a_non_streamed_request_gets_one_joined_line_per_choice(worker) -> None:
    client, _ = worker
    sampling = {"n": 2, "temperature": 0.7, "seed": 11}
    streamed = await read_stream(await client.post("/internal/generate", json=body("s", **sampling)))
    joined = await read_stream(await client.post("/internal/generate", json={**body("j", **sampling), "stream": False}))
    assert sorted(line["index"] for line in joined) == [0, 1]
    for line in joined:  # the same seed gives the same tokens, joined in order
        deltas = [d for d in streamed if d["index"] == line["index"]]
        assert line["token_ids"] == [t for d in deltas for t in d["token_ids"]]
        assert line["text"] == "".join(d["text"] for d in deltas)
        assert line["finish_reason"] == "length" and line["decode_s"] >= 0
    assert "usage" not in joined[0] and joined[-1]["usage"]["completion_tokens"] == 16
    assert joined[-1]["usage"]["prompt_tokens"] == streamed[-1]["usage"]["prompt_tokens"]


async def test_a_closed_connection_aborts_a_joined_request(worker) -> None:
    client, engine = worker
    response = await client.post("/internal/generate", json={**body("long", max_tokens=10_000), "stream": False})
    for _ in range(200):  # nothing is written before the end: wait until it runs
        if engine.info()["running"]:
            break
        await asyncio.sleep(0.02)
    response.close()  # the gateway hung up
    for _ in range(200):
        if engine.info()["finished"]:
            break
        await asyncio.sleep(0.05)
    info = engine.info()
    assert info["running"] == 0 and info["finished"] == {"abort": 1}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("not json", "not valid JSON"),
        ({"namespace": "a", "prompt_token_ids": [1]}, "request_id"),
        ({**body(), "prompt_token_ids": "hello"}, "prompt_token_ids"),
        ({**body(), "prompt_token_ids": []}, "no tokens"),
        ({**body(), "prompt_token_ids": [1, 10**9]}, "token ids"),
        ({**body(), "priority": "urgent"}, "priority"),
        ({**body(), "stream": "no"}, "stream must be true or false"),
        (body(top_p=0), "top_p"),
        (body(colour="blue"), "unknown sampling fields"),
        (body(max_tokens="many"), "must be a number"),
        (body(seed=1.5), "seed must be an integer"),
    ],
)
async def test_bad_input_is_a_400_with_a_message(worker, payload, message: str) -> None:
    client, _ = worker
    kwargs = {"data": payload} if isinstance(payload, str) else {"json": payload}
    response = await client.post("/internal/generate", **kwargs)
    assert response.status == 400
    assert message in (await response.json())["error"]["message"]


async def test_closed_connection_aborts_and_frees_blocks(worker) -> None:
    client, engine = worker
    response = await client.post("/internal/generate", json=body(max_tokens=10_000))
    first = json.loads(await response.content.readline())
    assert first["finish_reason"] is None
    response.close()  # the gateway hung up
    for _ in range(200):
        info = engine.info()
        if info["finished"]:
            break
        await asyncio.sleep(0.05)
    info = engine.info()
    assert info["running"] == 0 and info["finished"] == {"abort": 1}  # aborted, not run out
    blocks = info["blocks"]
    assert blocks["free"] + blocks["evictable"] == blocks["total"]


async def test_cancel_ends_the_stream_with_the_usage_so_far(worker) -> None:
    client, engine = worker
    response = await client.post("/internal/generate", json=body("r-cancel", max_tokens=10_000))
    lines = [json.loads(await response.content.readline())]
    cancelled = await client.post("/internal/requests/r-cancel/cancel")
    assert cancelled.status == 202
    lines += await read_stream(response)
    assert lines[-1]["finish_reason"] == "abort"
    streamed = sum(len(line["token_ids"]) for line in lines)
    assert lines[-1]["usage"]["completion_tokens"] == streamed  # billable exactly
    assert lines[-1]["usage"]["prompt_tokens"] == len(PROMPT)
    assert (await client.post("/internal/requests/unknown/cancel")).status == 202  # idempotent, harmless
    await asyncio.sleep(0.3)
    blocks = engine.info()["blocks"]
    assert blocks["free"] + blocks["evictable"] == blocks["total"]


async def test_info_health_and_metrics(worker) -> None:
    client, _ = worker
    await read_stream(await client.post("/internal/generate", json=body()))
    info = await (await client.get("/internal/info")).json()
    assert info["model"] == "tiny" and info["block_size"] == 8 and info["blocks"]["total"] == 64
    assert info["cache"]["tenant-a"]["miss_tokens"] >= len(PROMPT)
    assert (await (await client.get("/healthz")).json()) == {"status": "ok"}
    metrics = await (await client.get("/metrics")).text()
    assert "tollway_worker_completion_tokens_total 8.0" in metrics
    assert 'tollway_worker_kv_blocks{state="total"} 64.0' in metrics


async def test_n_choices_stream_with_their_index(worker) -> None:
    client, _ = worker
    lines = await read_stream(await client.post("/internal/generate", json=body("multi", n=2, temperature=0.7, seed=3)))
    by_choice = {i: [t for line in lines if line["index"] == i for t in line["token_ids"]] for i in (0, 1)}
    assert all(len(tokens) == 8 for tokens in by_choice.values())
    assert [line["finish_reason"] for line in lines].count("length") == 2
    assert "usage" in lines[-1] and lines[-1]["usage"]["completion_tokens"] == 16
    assert all("usage" not in line for line in lines[:-1])


async def test_an_engine_failure_ends_open_requests_with_error(worker, monkeypatch: pytest.MonkeyPatch) -> None:
    client, engine = worker

    def broken_step():
        raise RuntimeError("simulated engine bug")

    monkeypatch.setattr(engine.engine, "step", broken_step)
    lines = await read_stream(await client.post("/internal/generate", json=body("doomed")))
    assert lines[-1]["finish_reason"] == "error" and "usage" in lines[-1]
    monkeypatch.undo()
    healthy = await read_stream(await client.post("/internal/generate", json=body("after")))
    assert healthy[-1]["finish_reason"] == "length"  # the engine thread kept serving


async def test_tokenizer_files_let_the_gateway_tokenize_without_the_model(worker, tiny: LoadedModel) -> None:
    from workers.wire.tokenizer import TextTokenizer

    client, _ = worker
    payload = await (await client.get("/internal/tokenizer")).json()
    assert payload["model"] == "tiny"
    gateway_tokenizer = TextTokenizer.from_payload(payload)
    assert gateway_tokenizer.encode("w1 w2 w3") == tiny.tokenizer.encode("w1 w2 w3")



async def test_prompt_logprobs_come_on_the_first_line_streamed_or_joined(worker) -> None:
    client, _ = worker
    [only] = await read_stream(await client.post("/internal/generate", json=body("p0", max_tokens=0,
                                                                                   prompt_logprobs=2)))
    assert only["token_ids"] == [] and only["finish_reason"] == "length"  # max_tokens 0: the prompt alone
    assert len(only["prompt_logprobs"]) == len(PROMPT) - 1 and all(lp <= 0 for lp in only["prompt_logprobs"])
    assert [len(top) for top in only["prompt_top_logprobs"]] == [2] * (len(PROMPT) - 1)
    assert only["usage"] == {"prompt_tokens": len(PROMPT), "cached_tokens": 0, "completion_tokens": 0}
    streamed = await read_stream(await client.post("/internal/generate", json=body("p1", prompt_logprobs=0)))
    assert [("prompt_logprobs" in line) for line in streamed] == [True] + [False] * (len(streamed) - 1)
    [joined] = await read_stream(await client.post("/internal/generate",
                                                   json={**body("p2", prompt_logprobs=0), "stream": False}))
    assert joined["prompt_logprobs"] == pytest.approx(only["prompt_logprobs"], abs=1e-5)
    assert joined["prompt_top_logprobs"] == [[] for _ in PROMPT[1:]]
    assert len(joined["token_ids"]) == 8 and joined["usage"]["cached_tokens"] == 0  # recomputed, not served


async def test_max_tokens_zero_is_refused_with_n_above_one(worker) -> None:
    client, _ = worker
    response = await client.post("/internal/generate", json=body("bad", max_tokens=0, n=2))
    assert response.status == 400 and "max_tokens 0" in (await response.json())["error"]["message"]
