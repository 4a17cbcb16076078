"""Hand-written hostile requests against a real gateway process: each must get a clean 4xx (an
OpenAI error object) or a closed connection, never a 5xx or a hang, and the gateway keeps serving."""

from __future__ import annotations

import json
import socket
import time

import pytest
import requests

from tests.reliability.conftest import FakeStack
from tests.reliability.stack import MODEL, chat_body, headers

pytestmark = pytest.mark.reliability
TIMEOUT_S = 30


def post_raw(stack: FakeStack, path: str, body: bytes, content_type: str = "application/json",
             key: str | None = None, **extra_headers: str) -> requests.Response:
    sent = {"Content-Type": content_type, **headers(key or stack.keys["a"]), **extra_headers}
    return requests.post(f"{stack.url}{path}", data=body, headers=sent, timeout=TIMEOUT_S)


def assert_clean_4xx(response: requests.Response) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["type"]
    return error


def assert_still_serving(stack: FakeStack) -> None:
    response = requests.post(f"{stack.url}/v1/chat/completions", json=chat_body(),
                             headers=headers(stack.keys["a"]), timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text


CHAT = "/v1/chat/completions"
HEAD = b'{"model": "' + MODEL.encode() + b'", '
BAD_BODIES = {
    "deep_json_array": b"[" * 100_000 + b"]" * 100_000,
    "deep_json_in_messages": json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                         "stop": json.loads("[" * 500 + "]" * 500)}).encode(),
    "invalid_utf8_body": b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}',
    "lone_surrogate": HEAD + b'"messages": [{"role": "user", "content": "\\ud800"}]}',
    "nan_literal": HEAD + b'"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    "infinity_literal": HEAD + b'"messages": [], "top_p": Infinity}',
    "truncated_json": b'{"model": "' + MODEL.encode() + b'", "messages": [',
    "json_array_body": b"[1, 2, 3]",
    "json_string_body": b'"hello"',
    "empty_body": b"",
    "nul_bytes": b"\x00" * 1000,
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_malformed_bodies_get_a_400(fake_stack: FakeStack, name: str) -> None:
    response = post_raw(fake_stack, CHAT, BAD_BODIES[name])
    assert_clean_4xx(response)


BAD_PARAMS = {
    "negative_max_tokens": {"max_tokens": -1},
    "zero_max_tokens": {"max_tokens": 0},
    "huge_max_tokens": {"max_tokens": 10**30},
    "max_tokens_beyond_context": {"max_tokens": 1_000_000},
    "float_max_tokens": {"max_tokens": 1.5},
    "string_max_tokens": {"max_tokens": "16"},
    "negative_temperature": {"temperature": -1},
    "huge_temperature": {"temperature": 1e308},
    "huge_exponent_temperature": {"temperature": 1e400},
    "top_p_zero": {"top_p": 0},
    "top_p_above_one": {"top_p": 1.5},
    "huge_n": {"n": 10**9},
    "negative_n": {"n": -3},
    "huge_seed": {"seed": 2**200},
    "huge_top_logprobs": {"logprobs": True, "top_logprobs": 10**6},
    "penalty_out_of_range": {"presence_penalty": 1e9},
    "too_many_stops": {"stop": ["a", "b", "c", "d", "e"]},
    "stop_not_strings": {"stop": [1, 2]},
    "unknown_model": {"model": "no-such-model"},
    "messages_not_a_list": {"messages": "hi"},
    "message_without_role": {"messages": [{"content": "x"}]},
    "bool_as_number": {"temperature": True},
}


@pytest.mark.parametrize("name", sorted(BAD_PARAMS))
def test_out_of_range_parameters_get_a_4xx(fake_stack: FakeStack, name: str) -> None:
    body = {**chat_body(), **BAD_PARAMS[name]}
    assert_clean_4xx(post_raw(fake_stack, CHAT, json.dumps(body).encode()))


def test_unknown_fields_are_ignored_or_refused_but_never_a_5xx(fake_stack: FakeStack) -> None:
    body = {**chat_body(), "frobnicate": {"deep": [1, 2, 3]}, "namespace": "b", "tenant": "b"}
    response = post_raw(fake_stack, CHAT, json.dumps(body).encode())
    assert response.status_code == 200 or 400 <= response.status_code < 500, response.text
    # The cache namespace is set by the gateway; a client naming one changes nothing.
    assert "b" not in fake_stack.cluster.worker_info()["cache"]


def test_a_million_token_prompt_is_a_quick_400(fake_stack: FakeStack) -> None:
    started = time.monotonic()
    text = "ab " * 400_000  # 1.2 M characters = 1.2 M tokens for the fake worker's char tokenizer, < 4 MB
    response = post_raw(fake_stack, "/v1/completions",
                        json.dumps({"model": MODEL, "prompt": text, "max_tokens": 4}).encode())
    error = assert_clean_4xx(response)
    assert error["code"] == "context_length_exceeded"
    ids = post_raw(fake_stack, "/v1/completions",
                   json.dumps({"model": MODEL, "prompt": list(range(90)) * 5_000, "max_tokens": 4}).encode())
    assert_clean_4xx(ids)
    assert time.monotonic() - started < 20


def test_oversized_body_is_a_413(fake_stack: FakeStack) -> None:
    body = json.dumps(chat_body("x" * (5 * 2**20))).encode()  # over TOLLWAY_MAX_BODY_MB = 4
    try:
        response = post_raw(fake_stack, CHAT, body)
    except requests.ConnectionError:
        pass  # closing the connection on an oversized body is allowed
    else:
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert_still_serving(fake_stack)


@pytest.mark.parametrize("shape", ["one_huge_header", "many_headers", "huge_url"])
def test_oversized_headers_are_refused(fake_stack: FakeStack, shape: str) -> None:
    extra = {"one_huge_header": {"X-Big": "a" * 100_000},
             "many_headers": {f"X-H{i}": "v" for i in range(2_000)}, "huge_url": {}}[shape]
    path = CHAT + ("?q=" + "a" * 100_000 if shape == "huge_url" else "")
    try:
        response = post_raw(fake_stack, path, json.dumps(chat_body()).encode(), **extra)
    except requests.ConnectionError:
        pass
    else:
        assert 400 <= response.status_code < 500 and response.status_code != 404, response.status_code
    assert_still_serving(fake_stack)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml"])
def test_wrong_content_types(fake_stack: FakeStack, content_type: str) -> None:
    # A JSON body under another label is still read as JSON (as OpenAI does); a non-JSON body is a 400.
    response = post_raw(fake_stack, CHAT, b"model=x&messages=y", content_type)
    assert_clean_4xx(response)
    files = post_raw(fake_stack, "/v1/files", json.dumps({"purpose": "batch"}).encode())
    assert_clean_4xx(files)


def _slow_client(stack: FakeStack, head: bytes, send_body: bytes | None, hold_s: float) -> bytes:
    """Send `head` (and maybe part of a body), stall, then report what the gateway answered."""
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=hold_s) as sock:
        sock.sendall(head)
        if send_body:
            sock.sendall(send_body)
        try:
            return sock.recv(65536)  # b"" = closed by the gateway; a timeout = still open
        except TimeoutError:
            return b"<open>"


def test_slow_loris_clients_do_not_starve_others(fake_stack: FakeStack) -> None:
    import threading

    key = fake_stack.keys["a"]
    partial_head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n".encode()
    body = json.dumps(chat_body()).encode()
    slow_body = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    results: dict[int, bytes] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i,
        _slow_client(fake_stack, partial_head if i % 2 else slow_body, None if i % 2 else body[:10], 8.0)))
        for i in range(100)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    started = time.monotonic()
    for _ in range(20):  # while 100 stalled connections are open, others are served at once
        assert_still_serving(fake_stack)
    assert time.monotonic() - started < 10
    for thread in threads:
        thread.join()
    # TOLLWAY_READ_TIMEOUT_S (3 s here, 30 s by default) closes every stalled connection well within
    # the 8 s the clients hold: mid-headers silently (aiohttp's keep-alive timer), mid-body after a 408.
    for i, answer in sorted(results.items()):
        if i % 2:
            assert answer == b"", (i, answer[:100])
        else:
            assert answer.startswith(b"HTTP/1.1 408"), (i, answer[:100])
            assert b"request_timeout" in answer
