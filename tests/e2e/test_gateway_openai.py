"""The real `openai` SDK against `tollway up` on the default model: models, chat (plain and
streamed with usage), completions, the SDK's own exception classes, the prefix cache seen through
usage, and the supervisor restarting a crashed worker and stopping cleanly."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.e2e.tollway_up import Tollway, child_pids, start_tollway
from tests.net import get_json

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a concise assistant for a hardware store. Answer in one short sentence. " * 4


@pytest.fixture(scope="module")
def tollway(smollm2_folder: Path, model_home: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_tollway(tmp_path_factory.mktemp("up") / "home", model_home, TOLLWAY_DTYPE="float32")
    yield running
    if running.process.poll() is None:
        running.stop()


@pytest.fixture(scope="module")
def client(tollway: Tollway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tollway.base_url}/v1", api_key=tollway.new_key("acme"), max_retries=0)


def ask(client: openai.OpenAI, question: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=12, temperature=0, **kwargs)


def test_up_prints_nothing_secret_and_keeps_the_admin_key_private(tollway: Tollway) -> None:
    key_file = tollway.home / "admin.key"
    assert key_file.read_text().startswith("tw-admin-")
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert (tollway.home / "logs" / "gateway.log").exists() and (tollway.home / "logs" / "worker-0.log").exists()


def test_models_chat_and_cached_prefix(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    first = ask(client, "Do you sell hammers?")
    assert first.choices[0].message.content.strip()
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.completion_tokens <= 12
    second = ask(client, "Do you sell nails?")
    # The system prompt was computed for the first question: the second reuses its KV.
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.8 * (second.usage.prompt_tokens - 12)


def test_streamed_chat_equals_the_plain_answer_and_ends_with_usage(client: openai.OpenAI) -> None:
    plain = ask(client, "What are your opening hours?")
    chunks = list(ask(client, "What are your opening hours?", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content  # greedy: the same tokens either way
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert result.choices[0].text and result.usage.prompt_tokens > 0


def test_sdk_exceptions(tollway: Tollway, client: openai.OpenAI) -> None:
    stranger = openai.OpenAI(base_url=f"{tollway.base_url}/v1", api_key="tw-" + "x" * 43, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=5)
    assert "maximum context length is 8192 tokens" in str(too_long.value)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=5)
    assert "temperature" in str(bad.value)


def test_a_revoked_key_is_refused_at_once(tollway: Tollway) -> None:
    key = tollway.new_key("beta")
    client = openai.OpenAI(base_url=f"{tollway.base_url}/v1", api_key=key, max_retries=0)
    client.models.list()  # cached by the gateway now
    admin = (tollway.home / "admin.key").read_text().strip()
    keys = get_json(f"{tollway.base_url}/admin/v1/keys?tenant=beta", {"Authorization": f"Bearer {admin}"})
    [key_id] = [k["id"] for k in keys["data"] if k["prefix"] == key[:10]]
    request = urllib.request.Request(f"{tollway.base_url}/admin/v1/keys/{key_id}/revoke", method="POST",
                                     headers={"Authorization": f"Bearer {admin}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_a_crashed_worker_is_restarted(tollway: Tollway, client: openai.OpenAI) -> None:
    os.kill(tollway.worker_pid(0), signal.SIGKILL)
    time.sleep(1.0)
    tollway.wait_healthy(1, timeout_s=120)
    assert ask(client, "Do you sell saws?").choices[0].message.content.strip()


def test_sigterm_stops_every_child(tollway: Tollway) -> None:
    assert tollway.stop() == 0
    time.sleep(0.5)
    assert child_pids(f"ops.cli worker --port {tollway.worker_port}") == []
    assert child_pids(f"ops.cli gateway --port {tollway.port}") == []
