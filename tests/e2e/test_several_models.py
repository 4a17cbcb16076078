"""Two models behind one `tollway up --model A --model B` (issue 26), as real processes: the default
SmolLM2 model and a tiny random-weight Qwen3 folder built here (transformers' config class and
`save_pretrained`, SmolLM2's tokenizer files). Both answer the `openai` client, `/v1/models` lists
both, the tiny model's greedy tokens are transformers' own (so its requests really reach its worker),
and every usage row, the monthly report and its prices are per model."""

from __future__ import annotations

import csv
import io
import re
import shutil
import sqlite3
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import openai
import pytest
import torch
import transformers

from tests.e2e.tollway_up import Tollway, start_tollway
from tests.net import get_json
from tests.unit.workers.test_architectures import hf_greedy, write_family

pytestmark = pytest.mark.slow
DEFAULT = "smollm2-135m-instruct"
TINY = "tiny-qwen3"


@pytest.fixture(scope="module")
def tiny_folder(smollm2_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_family(tmp_path_factory.mktemp("models") / TINY, smollm2_folder, "Qwen3", {}, seed=3)
    shutil.copy(smollm2_folder / "chat_template.jinja", folder / "chat_template.jinja")  # for chat requests
    return folder


@pytest.fixture(scope="module")
def tollway(tiny_folder: Path, model_home: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_tollway(tmp_path_factory.mktemp("several") / "home", model_home,
                            models=[DEFAULT, str(tiny_folder)], TOLLWAY_DTYPE="float32")
    running.cli("prices", "set", TINY, "--input", "1", "--cached-input", "0.5", "--output", "2")  # before any request
    yield running
    if running.process.poll() is None:
        running.stop()


@pytest.fixture(scope="module")
def client(tollway: Tollway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tollway.base_url}/v1", api_key=tollway.new_key("acme"), max_retries=0,
                         timeout=120)


def test_both_models_answer_and_are_listed(tollway: Tollway, client: openai.OpenAI) -> None:
    assert sorted(model.id for model in client.models.list()) == sorted([DEFAULT, TINY])
    assert get_json(f"{tollway.base_url}/readyz?model={DEFAULT}&model={TINY}")["status"] == "ready"
    replies = {}
    for model in (DEFAULT, TINY):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                               max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert reply.model == model and reply.usage is not None and reply.usage.completion_tokens == 4
        replies[reply.id] = model
    with pytest.raises(openai.NotFoundError, match=re.escape(f"available: {DEFAULT}, {TINY}")):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    with sqlite3.connect(tollway.home / "tollway.db") as db:
        rows = dict(db.execute("SELECT request_id, model FROM usage_events").fetchall())
    assert {request_id: rows[request_id] for request_id in replies} == replies


def test_the_tiny_models_requests_reach_its_own_worker(tiny_folder: Path, client: openai.OpenAI) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_folder)
    prompt = tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    expected = tokenizer.decode(hf_greedy(theirs, prompt, 6), skip_special_tokens=True)
    ours = client.completions.create(model=TINY, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert ours.choices[0].text.strip() == expected.strip()  # as test_qwen3_generate_cli_equals_transformers
    default = client.completions.create(model=DEFAULT, prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert default.choices[0].text.strip() != expected.strip()  # the same prompt on the other model: another answer


def test_reports_and_prices_are_per_model(tollway: Tollway, client: openai.OpenAI) -> None:
    for model in (DEFAULT, TINY):
        client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    month = datetime.now(UTC).strftime("%Y-%m")
    report = {row["model"]: row for row in csv.DictReader(io.StringIO(
        tollway.cli("usage", "report", "--month", month, "--format", "csv")))}
    assert set(report) == {DEFAULT, TINY}
    default, tiny = report[DEFAULT], report[TINY]
    assert default["cost"] == "" and default["unpriced_requests"] == default["requests"]  # no price: never 0
    with sqlite3.connect(tollway.home / "tollway.db") as db:
        rows = db.execute("SELECT prompt_tokens, cached_tokens, completion_tokens FROM usage_events "
                          "WHERE model = ?", (TINY,)).fetchall()
    assert tiny["unpriced_requests"] == "0" and int(tiny["requests"]) == len(rows) >= 1
    expected = sum(((p - c) * 1 + c * Decimal("0.5") + n * 2) / 10**6 for p, c, n in rows)  # the tiny model's price
    assert Decimal(tiny["cost"]) == expected > 0
