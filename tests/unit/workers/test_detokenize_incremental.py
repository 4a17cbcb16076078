"""Incremental detokenization (workers/engine/detokenize.py) emits exactly what decoding the whole
output at every step emitted, with a byte-level BPE tokenizer (multi-byte characters split across
tokens) and stop strings."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from workers.engine.detokenize import OutputText

CORPUS = ["Hello, wörld! 你好，世界 🙂 naïve café — ok.", "The capital of France is Paris.", "emoji 👍🏽 ✓ done"]


class Codec:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def byte_level_codec() -> Codec:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return Codec(tokenizer)


def whole_decode_pieces(codec: Codec, ids: list[int], stop: tuple[str, ...]) -> list[str]:
    """The previous implementation: decode the whole output at every step."""
    emitted, pieces = 0, []
    for i in range(1, len(ids) + 1):
        text = codec.decode(ids[:i])
        found = [at for s in stop if (at := text.find(s, max(0, emitted - len(s) + 1))) != -1]
        if found:
            end = max(min(found), emitted)
            pieces.append(text[emitted:end])
            return pieces
        complete = text.rstrip("\ufffd")
        end = len(complete) - max((k for s in stop for k in range(1, len(s)) if complete.endswith(s[:k])), default=0)
        pieces.append(text[emitted:end] if end > emitted else "")
        emitted = max(emitted, end)
    pieces.append(codec.decode(ids)[emitted:])
    return pieces


def incremental_pieces(codec: Codec, ids: list[int], stop: tuple[str, ...]) -> list[str]:
    text = OutputText(codec, stop)  # type: ignore[arg-type]
    pieces = []
    for i in range(1, len(ids) + 1):
        piece, stopped = text.update(ids[:i])
        pieces.append(piece)
        if stopped:
            return pieces
    pieces.append(text.flush(ids))
    return pieces


def test_incremental_text_matches_decoding_the_whole_output_each_step() -> None:
    codec = byte_level_codec()
    vocab = codec._tokenizer.get_vocab_size()
    rng = random.Random(7)
    for trial in range(200):
        if trial % 2:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]  # often splits characters
        else:
            ids = codec._tokenizer.encode(rng.choice(CORPUS) * rng.randrange(1, 4)).ids
        stop = rng.choice([(), ("is",), ("ok", "\n"), ("🙂",)])
        assert incremental_pieces(codec, ids, stop) == whole_decode_pieces(codec, ids, stop), (ids, stop)
