"""`tollway worker` as a real process on the default model: NDJSON generate equals transformers'
greedy tokens, the second request hits the prefix cache, info and metrics answer; its internal API
refuses a caller without the workers' secret (TOLLWAY_WORKER_SECRET)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.e2e.test_generate_cli import tollway_executable
from tests.net import free_port, get_json
from workers.models.tokenizer import tokenizer_payload
from workers.wire.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow
SECRET = "tw-worker-e2e-secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}


def post_json(url: str, payload: dict, headers: dict[str, str] = AUTH) -> list[dict]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=120) as response:
        return [json.loads(line) for line in response.read().decode().splitlines()]


@pytest.fixture
def worker_url(smollm2_folder: Path, model_home: Path):
    port = free_port()
    process = subprocess.Popen(
        [tollway_executable(), "worker", "--port", str(port), "--dtype", "float32"],
        env={**os.environ, "TOLLWAY_HOME": str(model_home), "TOLLWAY_KV_CACHE_MB": "256",
             "TOLLWAY_WORKER_SECRET": SECRET},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=1)
                break
            except OSError:
                if process.poll() is not None:
                    pytest.fail(f"the worker exited: {process.stderr.read() if process.stderr else ''}")
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_worker_generates_like_transformers_and_caches(worker_url: str, smollm2_folder: Path) -> None:
    tokenizer = TextTokenizer.from_payload(tokenizer_payload(smollm2_folder))
    prompt = tokenizer.encode_chat([{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": "Name a prime number."}])
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    expected = expected[: expected.index(2)] if 2 in expected else expected  # eos is not emitted
    payload = {"request_id": "e2e-1", "namespace": "tenant-a", "prompt_token_ids": prompt,
               "sampling": {"max_tokens": 16, "temperature": 0}}
    with pytest.raises(urllib.error.HTTPError) as refused:
        post_json(f"{worker_url}/internal/generate", payload, headers={})
    assert refused.value.code == 401
    lines = post_json(f"{worker_url}/internal/generate", payload)
    assert [t for line in lines for t in line["token_ids"]] == expected
    assert "".join(line["text"] for line in lines).strip() == tokenizer.decode(expected).strip()
    assert lines[-1]["usage"]["cached_tokens"] == 0
    again = post_json(f"{worker_url}/internal/generate", {**payload, "request_id": "e2e-2"})
    assert again[-1]["usage"]["cached_tokens"] == len(prompt) - 1  # whole blocks + a partly matching one
    info = get_json(f"{worker_url}/internal/info", AUTH)
    assert info["model"] == "smollm2-135m-instruct" and info["running"] == 0
    metrics = urllib.request.urlopen(f"{worker_url}/metrics").read().decode()
    assert "tollway_worker_completion_tokens_total" in metrics
