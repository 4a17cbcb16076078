"""Speculative decoding through the gateway (issue 23's acceptance test): `tollway up` with
TOLLWAY_SPECULATIVE=ngram, the real `openai` client, repetitive prompts at temperature 0, four
requests at once (batched in the worker), streamed and not: every text equals what the same model
gives with speculation off, and the worker's /metrics show drafts were accepted, so the test cannot
pass with speculation silently off.

The texts without speculation come from an Engine in this process built as the worker builds its own
(`engine_config` of the same settings, speculation off), on the prompt ids the gateway computes: its
tokenizer code (`TextTokenizer.encode_chat`) on the tokenizer files the worker serves the gateway.
Both sides run the model in fp32, the precision of the engine's token-parity tests.
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ops.offline import engine_config
from tests.e2e.tollway_up import Tollway, start_tollway
from tests.net import get_json
from workers.engine.engine import Engine
from workers.models.loader import load_model
from workers.settings import WorkerSettings
from workers.wire.sampling import SamplingParams
from workers.wire.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 64
PASSAGE = ("Every worker keeps the attention keys and values of its running requests in fixed size blocks, "
           "so memory is handed out a little at a time. When two requests begin with the same system prompt, "
           "the second one finds those blocks in a prefix cache and skips the work of computing them again.")
ASKS = ["Repeat this passage exactly, word for word.", "Copy this text without changing anything.",
        "Please write out the passage below again, unchanged.", "Reproduce the following paragraph verbatim."]
CONVERSATIONS = [[{"role": "user", "content": f"{ask}\n\n{PASSAGE}"}] for ask in ASKS]
COUNTERS = ("drafted_tokens", "accepted_tokens", "verifications")


@pytest.fixture(scope="module")
def tollway(smollm2_folder: Path, model_home: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_tollway(tmp_path_factory.mktemp("up") / "home", model_home, TOLLWAY_DTYPE="float32",
                            TOLLWAY_SPECULATIVE="ngram")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(tollway: Tollway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tollway.base_url}/v1", api_key=tollway.new_key("acme"), max_retries=0)


@pytest.fixture(scope="module")
def expected(tollway: Tollway, smollm2_folder: Path) -> list[tuple[str, int]]:
    """(text, completion tokens) of each conversation with speculation off, computed while the stack idles."""
    payload = get_json(f"http://127.0.0.1:{tollway.worker_port}/internal/tokenizer", tollway.worker_auth())
    tokenizer = TextTokenizer.from_payload(payload)
    prompts = [tokenizer.encode_chat(messages) for messages in CONVERSATIONS]
    settings = WorkerSettings(speculative="off", dtype="float32", kv_cache_mb=512)
    engine = Engine(load_model(smollm2_folder, torch.float32), engine_config(settings))
    assert engine.config.speculative == "off"
    seqs = engine.generate_batch(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [(tokenizer.decode(s.output_ids), s.output_len) for s in seqs]


def speculative_counters(tollway: Tollway) -> dict[str, float]:
    """The worker's tollway_worker_speculative_* counters (absent when its engine does not speculate)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{tollway.worker_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert "tollway_worker_speculative_drafted_tokens_total" in samples, "the worker does not speculate"
    return {name: samples[f"tollway_worker_speculative_{name}_total"] for name in COUNTERS}


def answer(client: openai.OpenAI, messages: list[dict[str, str]], stream: bool) -> tuple[str, int]:
    """(text, completion tokens) of one temperature-0 chat completion, streamed or not."""
    if not stream:
        done = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                              max_tokens=MAX_TOKENS, temperature=0)
        return done.choices[0].message.content or "", done.usage.completion_tokens  # type: ignore[union-attr]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True}))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("streamed", [(False, True, False, True), (True, False, True, False)],
                         ids=["cold cache", "prompts cached"])
def test_four_at_once_give_the_text_speculation_off_gives(tollway: Tollway, client: openai.OpenAI,
                                                          expected: list[tuple[str, int]],
                                                          streamed: tuple[bool, ...]) -> None:
    before = speculative_counters(tollway)
    with ThreadPoolExecutor(max_workers=len(CONVERSATIONS)) as pool:
        answers = list(pool.map(lambda i: answer(client, CONVERSATIONS[i], streamed[i]), range(len(CONVERSATIONS))))
    after = speculative_counters(tollway)
    assert answers == expected
    assert sum(tokens for _, tokens in expected) >= 2 * MAX_TOKENS  # long answers: copying had room to pay
    # Drafts were verified in these requests' steps, and some were accepted (a repeated passage copies well).
    drafted, accepted, verifications = (after[name] - before[name] for name in COUNTERS)
    assert verifications > 0 and drafted > 0
    assert accepted > 0.3 * drafted, (accepted, drafted)
