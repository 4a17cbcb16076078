"""Incremental output text with stop strings: emit only text that can no longer become a stop string.

Each update decodes the whole output (outputs are short next to the model's cost per token) and
emits the new part, holding back (1) a trailing U+FFFD, an incomplete multi-byte character, and
(2) the longest tail that is the start of some stop string. When a stop string appears, the text
up to it is emitted and the string itself never is.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.models.tokenizer import TokenCodec


class OutputText:
    def __init__(self, tokenizer: TokenCodec, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.emitted = 0  # characters of the decoded output already handed out

    def update(self, output_ids: list[int]) -> tuple[str, bool]:
        """(new text to emit, whether a stop string was reached)."""
        text = self.tokenizer.decode(output_ids)
        earliest = None
        for stop in self.stop:
            at = text.find(stop, max(0, self.emitted - len(stop) + 1))
            if at != -1 and (earliest is None or at < earliest):
                earliest = at
        if earliest is not None:
            return self._emit(text, max(earliest, self.emitted)), True
        complete = text.rstrip("\ufffd")
        hold = max((k for stop in self.stop for k in range(1, len(stop)) if complete.endswith(stop[:k])), default=0)
        return self._emit(text, len(complete) - hold), False

    def flush(self, output_ids: list[int]) -> str:
        """Everything not yet emitted (the sequence ended without a stop string)."""
        return self._emit(self.tokenizer.decode(output_ids), None)

    def _emit(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        if end <= self.emitted:
            return ""
        piece = text[self.emitted : end]
        self.emitted = end
        return piece
