"""Word-by-word tokenization of ASCII text gives exactly `tokenizers`' ids on the default model's
byte-level BPE (random texts of the GPT-2 split's corner cases), leaves other text to `tokenizers`,
and is refused for tokenizers whose pre-tokenization is not GPT-2's split alone."""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import BPE

from workers.models.tokenizer import tokenizer_payload
from workers.wire.byte_level_words import ByteLevelWords, splits_like_gpt2
from workers.wire.token_segments import SegmentEncoder
from workers.wire.tokenizer import TextTokenizer

# Each a corner of the split: contractions (and near misses), runs of each whitespace character the
# two regex dialects could disagree on (\x1c-\x1f are whitespace to Python's \s, not to Oniguruma's),
# a space before a letter, a digit or punctuation, whitespace at the end.
FRAGMENTS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'x", "'", "''", "don't", "we're", "it's",
             " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", " \t",
             "\t ", "a", "Hello", " world", "x1", "1x", "123", " 4567", " 8", "3.14", "(", " (", "!?", " ...",
             "_", "__init__", "-", " -", "\x00", "\x7f", "~`@#$%^&*", "a b", "a  b", "a \n b", "end. "]


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    texts = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 10))) for _ in range(count)]
    texts += ["".join(rng.choice(string.printable + "\x1c\x1f\x00") for _ in range(rng.randint(1, 40)))
              for _ in range(count)]
    return texts


@pytest.fixture(scope="module")
def smollm2(smollm2_folder: Path) -> Tokenizer:
    return TextTokenizer.from_payload(tokenizer_payload(smollm2_folder))._tokenizer


def test_word_ids_equal_tokenizers_ids(smollm2: Tokenizer) -> None:
    words = ByteLevelWords.for_tokenizer(smollm2)
    assert words is not None  # SmolLM2's pre-tokenizer is GPT-2's byte-level split alone
    cases = random_texts(0, 2000)
    for _ in range(2):  # the second pass is served from the word cache
        for text in cases:
            assert words.encode(text) == smollm2.encode(text, add_special_tokens=False).ids, repr(text)


def test_long_words_are_tokenized_each_time_not_cached(smollm2: Tokenizer) -> None:
    words = ByteLevelWords.for_tokenizer(smollm2)
    assert words is not None
    text = " " + "abc" * 40 + " " + "7" * 50 + " ok"
    assert words.encode(text) == smollm2.encode(text, add_special_tokens=False).ids
    assert words._word.cache_info().currsize == 1  # " ok" only


def test_non_ascii_text_is_left_to_tokenizers(smollm2: Tokenizer) -> None:
    words = ByteLevelWords.for_tokenizer(smollm2)
    assert words is not None
    assert words.encode("héllo") is None
    segments = SegmentEncoder.for_tokenizer(smollm2)
    assert segments is not None
    for text in ["héllo wörld", "日本語 and ASCII", "naïve café 🙂"]:
        assert segments.encode(text) == smollm2.encode(text, add_special_tokens=False).ids


def test_words_are_cached_per_scope(smollm2: Tokenizer) -> None:
    words = ByteLevelWords.for_tokenizer(smollm2)
    assert words is not None
    words.encode("same words", scope="tenant:1")
    before = words._word.cache_info()
    words.encode("same words", scope="tenant:2")
    after = words._word.cache_info()
    assert after.hits == before.hits and after.misses == before.misses + 2


def byte_level_bpe(**pre: bool) -> Tokenizer:
    tokenizer = Tokenizer(BPE(vocab={chr(c): c for c in range(33, 127)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(**pre)
    return tokenizer


def test_only_gpt2s_split_alone_is_taken() -> None:
    assert splits_like_gpt2(byte_level_bpe(add_prefix_space=False, use_regex=True))
    assert not splits_like_gpt2(byte_level_bpe(add_prefix_space=True, use_regex=True))
    assert not splits_like_gpt2(byte_level_bpe(add_prefix_space=False, use_regex=False))
    normalized = byte_level_bpe(add_prefix_space=False, use_regex=True)
    normalized.normalizer = normalizers.Lowercase()
    assert not splits_like_gpt2(normalized)
    other_split = byte_level_bpe(add_prefix_space=False, use_regex=True)
    other_split.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert not splits_like_gpt2(other_split)
    assert ByteLevelWords.for_tokenizer(other_split) is None
