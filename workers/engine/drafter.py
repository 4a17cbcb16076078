"""Drafters for speculative decoding: what a sequence's next tokens will probably be.

A drafter proposes up to k tokens to follow a sequence's tokens (prompt + output); the engine
verifies them in its next batched step (workers/engine/speculative.py), so a bad proposal costs
only compute, never correctness. Proposals are point masses (q(t) = 1 for the proposed token):
rejection sampling then accepts a drafted token t with probability p(t).

`NgramDrafter` is prompt lookup: find the most recent earlier occurrence of the sequence's last n
tokens (n from `max_ngram` down to `min_ngram`) and propose the (up to) k tokens that followed it.
It needs no second model; it pays off where the output repeats the context (quoting, RAG answers,
code edits, JSON). `ModelDrafter` (workers/engine/draft_model.py) drafts with a second, smaller model
sharing the target's tokenizer; it keeps a cache per sequence, so `propose` takes the sequence as `key`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from workers.engine.draft_model import DraftTarget
    from workers.engine.request import Sequence

SpeculativeMode = Literal["off", "ngram", "draft"]
SPECULATIVE_MODES: tuple[str, ...] = ("off", "ngram", "draft")


class Drafter(Protocol):
    def propose(self, token_ids: Seq[int], k: int, key: Sequence | None = None) -> list[int]:
        """Up to k tokens likely to follow `token_ids` (possibly none); `key`: the sequence they are
        (a drafter may keep state per sequence, never beyond the sequence's life)."""
        ...


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: Seq[int], k: int, key: Sequence | None = None) -> list[int]:
        tokens = list(token_ids)
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            pattern = tokens[length - n:]
            last = pattern[-1]
            # newest earlier occurrence first: the nearest context predicts best
            for end in range(length - 2, n - 2, -1):  # `end`: the index of the occurrence's last token
                if tokens[end] == last and tokens[end - n + 1 : end + 1] == pattern:
                    return tokens[end + 1 : end + 1 + k]
        return []


def check_speculative(mode: str, draft_model: str | None) -> None:
    """ValueError for a mode this build cannot run, or `draft` without a draft model (no model loaded)."""
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative mode must be one of {', '.join(SPECULATIVE_MODES)}, got {mode!r}")
    if mode == "draft" and not draft_model:
        raise ValueError("TOLLWAY_SPECULATIVE=draft needs TOLLWAY_DRAFT_MODEL: a model name or local folder "
                         "sharing the model's tokenizer (a smaller size of the same family)")


def make_drafter(mode: SpeculativeMode, max_ngram: int = 3, draft_model: str | Path | None = None,
                 target: DraftTarget | None = None) -> Drafter | None:
    """The drafter of a mode; None for `off`. ValueError for what this build cannot do; `draft`
    loads `draft_model` (a resolved folder) against `target`, the model it drafts for."""
    check_speculative(mode, str(draft_model) if draft_model is not None else None)
    if mode == "off":
        return None
    if mode == "ngram":
        return NgramDrafter(max_ngram)
    if target is None:
        raise ValueError("a draft model needs the target model's vocabulary, dtype and device")
    from workers.engine.draft_model import ModelDrafter  # transformers, only where a draft model is asked for

    return ModelDrafter.load(Path(str(draft_model)), target)
