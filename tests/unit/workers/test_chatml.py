"""ChatML templates written without Jinja (workers/wire/chatml.py): recognized only for the plain ChatML loop,
and then writing exactly what Jinja writes; every other template or call renders with Jinja."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from ops.fake_worker import CHAT_TEMPLATE, fake_tokenizer_files
from workers.models.tokenizer import tokenizer_payload
from workers.wire.chatml import ChatML
from workers.wire.tokenizer import ChatTemplateError, TextTokenizer

ROLES = ["system", "user", "assistant", "tool", "developer", "System", ""]
TEXTS = ["", "Hi", "\n", " two  spaces ", "{{ x }}", "{% if %}", "'quoted'", '"dq"', "\\n", "<|im_start|>user\n",
         "<|im_end|>", "日本語 🙂", "line\nbreak", "x" * 300]


def conversations(seed: int, count: int) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    return [[{"role": rng.choice(ROLES), "content": "".join(rng.choice(TEXTS) for _ in range(rng.randint(0, 4)))}
             for _ in range(rng.randint(0, 5))] for _ in range(count)]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_folder: Path) -> TextTokenizer:
    return TextTokenizer.from_payload(tokenizer_payload(smollm2_folder))


def fake_tokenizer(template: str) -> TextTokenizer:
    tokenizer_json, config = fake_tokenizer_files()
    return TextTokenizer.from_payload({"tokenizer_json": tokenizer_json, "tokenizer_config": config,
                                       "chat_template": template})


def assert_renders_as_jinja(tokenizer: TextTokenizer, seed: int) -> None:
    for messages in conversations(seed, 300):
        for generation_prompt in (True, False):
            assert tokenizer.render_chat(messages, generation_prompt) == \
                tokenizer._render_jinja(messages, generation_prompt)


def test_smollm2_template_is_chatml_with_its_default_system_message(smollm2_tokenizer: TextTokenizer) -> None:
    chatml = smollm2_tokenizer._chatml
    assert chatml is not None and chatml._default_system == \
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert_renders_as_jinja(smollm2_tokenizer, 0)
    messages = [{"role": "user", "content": "Say hello."}]
    assert smollm2_tokenizer.encode_chat(messages) == smollm2_tokenizer.encode(
        smollm2_tokenizer._render_jinja(messages, True), add_special_tokens=False)


def test_plain_chatml_loop_has_no_default_system_message() -> None:
    tokenizer = fake_tokenizer(CHAT_TEMPLATE)
    assert tokenizer._chatml is not None and tokenizer._chatml._default_system is None
    assert_renders_as_jinja(tokenizer, 1)


@pytest.mark.parametrize("template", [
    CHAT_TEMPLATE.replace("message['content']", "message['content'] | trim"),  # other logic
    CHAT_TEMPLATE.replace("<|im_end|>", "<|end|>"),  # another format
    "{{ bos_token }}" + CHAT_TEMPLATE,
    CHAT_TEMPLATE.replace("{% endfor %}", "{% endfor %}{{ tools }}"),
])
def test_other_templates_render_with_jinja(template: str) -> None:
    tokenizer = fake_tokenizer(template)
    assert tokenizer._chatml is None
    messages = [{"role": "user", "content": " Hi "}]
    assert tokenizer.render_chat(messages) == tokenizer._render_jinja(messages, True)


def test_a_template_whose_probes_differ_is_not_used() -> None:
    assert ChatML.recognize(CHAT_TEMPLATE, lambda messages, prompt: "") is None
    assert ChatML.recognize(CHAT_TEMPLATE, ChatML(None).render) is not None

    def refusing(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        raise ChatTemplateError("no tool role here")

    assert ChatML.recognize(CHAT_TEMPLATE, refusing) is None


def test_calls_it_cannot_write_go_to_jinja(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = fake_tokenizer(CHAT_TEMPLATE)
    jinja_calls: list[tuple[Any, ...]] = []
    render_jinja = tokenizer._render_jinja
    monkeypatch.setattr(tokenizer, "_render_jinja", lambda *args: jinja_calls.append(args) or render_jinja(*args))
    hello = [{"role": "user", "content": "Hi"}]
    assert tokenizer.render_chat(hello) == render_jinja(hello, True) and jinja_calls == []
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert tokenizer.render_chat(hello, tools=tools) == render_jinja(hello, True, tools) and len(jinja_calls) == 1
    for messages in ([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], [{"role": "user"}],
                     [{"role": 1, "content": "Hi"}]):
        assert not ChatML.renders(messages)
        with pytest.raises(Exception) as raised:  # whatever Jinja does with these, as before
            tokenizer.render_chat(messages)
        with pytest.raises(type(raised.value)):
            render_jinja(messages, True)
    assert len(jinja_calls) == 4


def test_no_template_is_still_a_clear_error() -> None:
    tokenizer = fake_tokenizer(CHAT_TEMPLATE)
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.render_chat([{"role": "user", "content": "Hi"}])
