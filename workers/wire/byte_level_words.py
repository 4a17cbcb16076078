"""Tokenizing ASCII text word by word for GPT-2-style byte-level BPE tokenizers, words cached.

A byte-level BPE tokenizer (GPT-2's, SmolLM2's) first splits a text with one regex into "words"
(`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`), then merges
the bytes of each word on its own: a text's ids are its words' ids joined. `tokenizers` runs that
regex on Oniguruma, which costs ~12 us for a 26-character chat message, most of the message's
tokenization. Python's `re` splits the same message in ~1.8 us, and a word's ids come from a cache.

Exactness: the split is done here only for ASCII text, where the regex's Unicode classes have exact
ASCII spellings (letters `A-Za-z`, digits `0-9`, and Oniguruma's `\\s`, Unicode White_Space, is
`\\t\\n\\x0b\\x0c\\r` and the space; not `\\x1c`-`\\x1f`, which Python's `\\s` would take). Other
text returns None and goes to `tokenizers` whole. A word's ids are `tokenizers`' own for the word
alone, kept only when `tokenizers` saw that word as one pre-token (its `word_ids` all 0), so a word
the split here would cut differently is never cached. tests/unit/workers/test_byte_level_words.py
compares both on random texts built from the split's corner cases.

Words are cached per `scope`, as `token_segments` caches pieces.
"""

from __future__ import annotations

import functools
import json
import re

from tokenizers import Tokenizer

CACHED_WORDS = 32768
"""Distinct (scope, word) pairs kept, least recently used out first."""
MAX_CACHED_WORD_CHARS = 32
"""Longer words are tokenized each time instead of held: the cache holds at most ~50 MiB (32-character
words of a token a character), a few MiB for words of prose."""

_LETTER, _DIGIT, _SPACE = "A-Za-z", "0-9", "\\t\\n\\x0b\\x0c\\r "
_ASCII_WORDS = re.compile(
    "'s|'t|'re|'ve|'m|'ll|'d"
    f"| ?[{_LETTER}]+| ?[{_DIGIT}]+| ?[^{_SPACE}{_LETTER}{_DIGIT}]+"
    f"|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"
).findall


def splits_like_gpt2(tokenizer: Tokenizer) -> bool:
    """True when `tokenizer` is a byte-level BPE whose only text processing before the merges is
    GPT-2's regex split: no normalizer, a lone ByteLevel pre-tokenizer with its regex on and no
    prefix space, no truncation or padding, and no BPE dropout (which makes ids random)."""
    config = json.loads(tokenizer.to_str())
    pre = config.get("pre_tokenizer") or {}
    model = config.get("model") or {}
    return (config.get("normalizer") is None and config.get("truncation") is None
            and config.get("padding") is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
            and model.get("type") == "BPE" and model.get("dropout") is None)


class ByteLevelWords:
    """Ids of ASCII text without added tokens, as `tokenizer.encode(text, add_special_tokens=False)`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._word = functools.lru_cache(maxsize=CACHED_WORDS)(self._encode_word)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ByteLevelWords | None:
        return cls(tokenizer) if splits_like_gpt2(tokenizer) else None

    def encode(self, text: str, scope: str = "") -> list[int] | None:
        """The ids of `text` (which holds no added token), or None when it is not ASCII or a word
        does not stand alone in `tokenizers`' own split: the caller then encodes it whole."""
        if not text.isascii():
            return None
        ids: list[int] = []
        for word in _ASCII_WORDS(text):
            word_ids = self._word(word, scope) if len(word) <= MAX_CACHED_WORD_CHARS else self._encode_word(word, scope)
            if word_ids is None:
                return None
            ids.extend(word_ids)
        return ids

    def _encode_word(self, word: str, scope: str) -> tuple[int, ...] | None:
        del scope  # only part of the cache's key
        encoding = self._tokenizer.encode(word, add_special_tokens=False)
        if any(index != 0 for index in encoding.word_ids):
            return None  # tokenizers split it: never expected for ASCII (see the module doc)
        # A tuple: cached results are shared, so nothing may change them.
        return tuple(encoding.ids)
