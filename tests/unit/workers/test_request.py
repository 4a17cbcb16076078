"""Sequence's views of its ids (workers/engine/request.py)."""

from __future__ import annotations

from workers.engine.request import Sequence
from workers.wire.sampling import SamplingParams


def test_ids_between_slices_prompt_and_output_as_all_ids() -> None:
    s = Sequence("r", [1, 2, 3, 4], SamplingParams(), output_ids=[5, 6, 7])
    for start in range(8):
        for end in range(start, 8):
            assert s.ids_between(start, end) == s.all_ids[start:end]
