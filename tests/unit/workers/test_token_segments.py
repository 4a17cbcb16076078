"""Segment-cached tokenization gives exactly the ids of tokenizing the whole text (the default
model's tokenizer, tricky texts), and is refused for tokenizers whose added tokens depend on their
neighbours."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from workers.models.tokenizer import tokenizer_payload
from workers.wire.token_segments import SegmentEncoder
from workers.wire.tokenizer import TextTokenizer

PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "|>", "<", "<<|im_end|>>", "system", "user",
          "assistant", "\n", "\n\n", " ", "  ", "\t", "Hello", " world", "héllo", "日本語", "🙂", "123", "4567",
          "don't", "  indented", "<file_sep>", "a<|im_end|>b", "", "x" * 50]


def texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12))) for _ in range(count)]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_folder: Path) -> TextTokenizer:
    return TextTokenizer.from_payload(tokenizer_payload(smollm2_folder))


def test_segment_ids_equal_whole_text_ids(smollm2_tokenizer: TextTokenizer) -> None:
    whole = smollm2_tokenizer._tokenizer
    encoder = SegmentEncoder.for_tokenizer(whole)
    assert encoder is not None  # SmolLM2's added tokens are all plain (the fast path is on for it)
    cases = texts(0, 400) + [smollm2_tokenizer.render_chat([{"role": "user", "content": "Say hello."}])]
    for _ in range(2):  # the second pass is served from the cache
        for text in cases:
            assert encoder.encode(text) == whole.encode(text, add_special_tokens=False).ids, repr(text)


def test_chat_prompts_tokenize_as_before(smollm2_tokenizer: TextTokenizer) -> None:
    whole = smollm2_tokenizer._tokenizer
    for n in range(3):
        messages = [{"role": "system", "content": "You answer in French."},
                    {"role": "user", "content": f"Question {n}: what is 2+{n}?"}]
        text = smollm2_tokenizer.render_chat(messages)
        assert smollm2_tokenizer.encode_chat(messages) == whole.encode(text, add_special_tokens=False).ids


def test_cached_pieces_are_not_changed_by_callers(smollm2_tokenizer: TextTokenizer) -> None:
    encoder = SegmentEncoder.for_tokenizer(smollm2_tokenizer._tokenizer)
    assert encoder is not None
    first = encoder.encode("<|im_start|>system\nSame text<|im_end|>")
    first.append(-1)
    assert encoder.encode("<|im_start|>system\nSame text<|im_end|>") == first[:-1]


def _word_tokenizer(*added: AddedToken) -> Tokenizer:
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(list(added))
    return tokenizer


def test_tokenizers_whose_added_tokens_touch_their_neighbours_are_refused() -> None:
    plain = _word_tokenizer(AddedToken("<s>", special=True, normalized=False))
    assert SegmentEncoder.for_tokenizer(plain) is not None
    assert SegmentEncoder.for_tokenizer(_word_tokenizer(AddedToken("<s>", special=True, lstrip=True,
                                                                   normalized=False))) is None
    assert SegmentEncoder.for_tokenizer(_word_tokenizer(AddedToken("<s>", special=True, normalized=True))) is None
    plain.encode_special_tokens = True
    assert SegmentEncoder.for_tokenizer(plain) is None


def test_pieces_are_cached_per_scope(smollm2_tokenizer: TextTokenizer) -> None:
    encoder = SegmentEncoder.for_tokenizer(smollm2_tokenizer._tokenizer)
    assert encoder is not None
    text = "<|im_start|>system\nA tenant's own system prompt<|im_end|>\n"
    misses = lambda: encoder._cached.cache_info().misses  # noqa: E731
    encoder.encode(text, "tenant-1")
    before = misses()
    assert encoder.encode(text, "tenant-1") == encoder.encode(text, "tenant-2")
    assert misses() - before == 2  # tenant-2 tokenized both pieces itself; tenant-1's were cached
