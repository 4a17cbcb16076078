"""Prompt logprobs as evaluation harnesses ask for them (lm-evaluation-harness `local-completions`:
`echo`, `logprobs`, `max_tokens` 0 or 1), through the real `openai` SDK against `tollway up` in fp32
with chunked prefill (64-token steps): one logprob per prompt token after the first, equal to a
teacher-forced transformers forward on the same converted folder, also for a prompt the prefix cache
holds (it is recomputed for them)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.tollway_up import Tollway, start_tollway

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
TEXT_FILE = Path(__file__).resolve().parents[1] / "data" / "declaration_and_lincoln.txt"


@pytest.fixture(scope="module")
def tollway(model_home: Path, tmp_path_factory: pytest.TempPathFactory):
    running = start_tollway(tmp_path_factory.mktemp("up") / "home", model_home, TOLLWAY_DTYPE="float32",
                            TOLLWAY_MAX_BATCH_TOKENS="64")
    yield running
    if running.process.poll() is None:
        running.stop()


@pytest.fixture(scope="module")
def client(tollway: Tollway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tollway.base_url}/v1", api_key=tollway.new_key("evals"), max_retries=0)


@pytest.fixture(scope="module")
def teacher(smollm2_folder: Path):
    """Teacher-forced log-softmax [P, V] of token ids, by transformers in fp32."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(dim=-1)

    return log_softmax


@pytest.fixture(scope="module")
def prompt_ids(smollm2_folder: Path) -> list[int]:
    """About 300 tokens of the test text: five 64-token prefill steps."""
    text = TEXT_FILE.read_text(encoding="utf-8")
    return AutoTokenizer.from_pretrained(smollm2_folder)(text[:1400])["input_ids"]


def assert_teacher_forced(logprobs, ids: list[int], expected: torch.Tensor, k: int) -> None:
    """The prompt part of a legacy logprobs object equals the teacher-forced values (within 1e-3)."""
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    got = torch.tensor(logprobs.token_logprobs[1 : len(ids)])
    want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-3
    top_values = expected[:-1].topk(k, dim=-1).values
    for position, top in enumerate(logprobs.top_logprobs[1 : len(ids)]):
        # alternatives with the same text share a key: the best value of each key is among the top k
        assert 1 <= len(top) <= k and abs(max(top.values()) - top_values[position, 0].item()) <= 1e-3


def test_echo_of_the_prompt_alone_gives_teacher_forced_logprobs(client: openai.OpenAI, prompt_ids: list[int],
                                                               teacher) -> None:
    assert len(prompt_ids) > 4 * 64  # several prefill steps
    result = client.completions.create(model=MODEL, prompt=prompt_ids, echo=True, logprobs=3, max_tokens=0,
                                       temperature=0)
    [choice] = result.choices
    assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == len(prompt_ids)
    assert choice.text == "".join(choice.logprobs.tokens)
    assert_teacher_forced(choice.logprobs, prompt_ids, teacher(prompt_ids), 3)
    assert result.usage.prompt_tokens == len(prompt_ids) and result.usage.completion_tokens == 0


def test_prompt_tokens_in_the_prefix_cache_still_get_their_logprobs(client: openai.OpenAI, prompt_ids: list[int],
                                                                    teacher) -> None:
    ids = prompt_ids[:150] + [11, 253, 3010]  # a prompt of its own, then cached by plain requests
    plain = [client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0) for _ in range(2)]
    assert plain[1].usage.prompt_tokens_details.cached_tokens >= 144  # the cache holds the prompt
    echoed = [client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=0)
              for _ in range(2)]
    expected = teacher(ids)
    for result in echoed:  # recomputed (usage says so), each time complete and exact
        assert result.usage.prompt_tokens_details.cached_tokens == 0
        assert len(result.choices[0].logprobs.token_logprobs) == len(ids)
        assert_teacher_forced(result.choices[0].logprobs, ids, expected, 2)
    after = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    assert after.usage.prompt_tokens_details.cached_tokens >= 144  # and still serves others from cache


def test_loglikelihood_request_as_a_harness_sends_it(client: openai.OpenAI, prompt_ids: list[int],
                                                     teacher) -> None:
    """lm-evaluation-harness's loglikelihood call: context + continuation as token ids, echo,
    logprobs 1, max_tokens 1, temperature 0; it reads token_logprobs[ctxlen:-1] and checks greediness
    against top_logprobs."""
    context, continuation = prompt_ids[:100], prompt_ids[100:108]
    ids = context + continuation
    result = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                       temperature=0, seed=1234)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(ids) + 1  # the prompt's, then the generated token's
    expected = teacher(ids)
    want = expected[torch.arange(len(context) - 1, len(ids) - 1), torch.tensor(continuation)]
    got = torch.tensor(logprobs.token_logprobs[len(context) : -1])
    assert (got - want).abs().max().item() <= 1e-3
    greedy = all(lp == max(top.values()) for lp, top in
                 zip(logprobs.token_logprobs[len(context) : -1], logprobs.top_logprobs[len(context) : -1],
                     strict=True))
    assert greedy == bool((expected[len(context) - 1 : len(ids) - 1].argmax(dim=-1)
                           == torch.tensor(continuation)).all())
    # the generated token goes on after the prompt, in the text and the offsets
    assert result.choices[0].text == result.choices[0].text[: logprobs.text_offset[-1]] + logprobs.tokens[-1]


def test_streamed_echo_equals_the_joined_answer(client: openai.OpenAI) -> None:
    prompt = "The unanimous Declaration of the thirteen united States of America,"
    joined = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=6,
                                       temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=6,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text == prompt  # the prompt first, as sent
    assert "".join(c.choices[0].text for c in chunks if c.choices) == joined.choices[0].text
    assert joined.choices[0].text.startswith(prompt)
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    whole = joined.choices[0].logprobs.token_logprobs
    assert streamed[0] is None and whole[0] is None and streamed[1:] == pytest.approx(whole[1:], abs=1e-5)
    assert len(streamed) == joined.usage.prompt_tokens + joined.usage.completion_tokens


def test_max_tokens_zero_needs_echo(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Four score", max_tokens=0)
    assert refused.value.param == "max_tokens"
