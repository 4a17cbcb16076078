"""Drafters for speculative decoding: what a sequence's next tokens will probably be.

A drafter proposes up to k tokens to follow a sequence's tokens (prompt + output); the engine
verifies them in its next batched step (workers/engine/speculative.py), so a bad proposal costs
only compute, never correctness. Proposals are point masses (q(t) = 1 for the proposed token):
rejection sampling then accepts a drafted token t with probability p(t).

`NgramDrafter` is prompt lookup: find the most recent earlier occurrence of the sequence's last n
tokens (n from `max_ngram` down to `min_ngram`) and propose the (up to) k tokens that followed it.
It needs no second model; it pays off where the output repeats the context (quoting, RAG answers,
code edits, JSON).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Literal, Protocol

SpeculativeMode = Literal["off", "ngram", "draft"]
SPECULATIVE_MODES: tuple[str, ...] = ("off", "ngram", "draft")


class Drafter(Protocol):
    def propose(self, token_ids: Seq[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `token_ids` (possibly none)."""
        ...


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: Seq[int], k: int) -> list[int]:
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


def make_drafter(mode: SpeculativeMode, max_ngram: int = 3) -> Drafter | None:
    """The drafter of a mode; None for `off`. ValueError for what this build cannot do."""
    if mode == "off":
        return None
    if mode == "ngram":
        return NgramDrafter(max_ngram)
    if mode == "draft":
        raise ValueError("TOLLWAY_SPECULATIVE=draft (a second, smaller draft model) is not built yet; "
                         "use ngram or off")
    raise ValueError(f"speculative mode must be one of {', '.join(SPECULATIVE_MODES)}, got {mode!r}")
