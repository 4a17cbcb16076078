"""Verification as decode rows: a step whose sequences all decode (no prefill chunk), some carrying
a speculative draft, laid out as one-token rows so it runs as a decode step (on the CPU the fused
native step, workers/models/fused_decode.py) instead of the eager extend path.

A sequence with `computed_len` c running n = k + 1 tokens (its newest token, then k drafted ones)
at positions c .. c + k becomes n rows; row j is a one-token "sequence" with context length
c + j + 1 that shares the sequence's block table. Causality holds by construction:
- every row's K/V is written before any row attends (the fused step's `rotary_store` runs over
  all rows before `paged_decode`; the eager layers store the step's K/V before attention), and
- row j reads exactly the first c + j + 1 positions: its prefix, its newest token, the draft tokens
  before it and itself, as extend attention over the k + 1 positions does.
The flat token order is that of the extend layout, so the rows whose logits a step returns keep
their indices (runner.py `_draft_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.metadata import Backend, PagedAttentionMetadata


def all_decoding(num_new: Sequence[int], drafts: Sequence[Sequence[int]]) -> bool:
    """Whether every sequence runs one token plus its draft (a step with no prefill chunk)."""
    return all(n == 1 + len(draft) for n, draft in zip(num_new, drafts, strict=True))


def expand(num_new: Sequence[int], computed_lens: Sequence[int], block_tables: torch.Tensor, block_size: int,
           backend: Backend | None = None) -> PagedAttentionMetadata:
    """The metadata of a step as one-token rows: sequence s (computed_lens[s] tokens held before
    the step, num_new[s] run in it, row s of `block_tables` [S, max_blocks] int32) becomes
    num_new[s] rows with context lengths computed_lens[s] + 1 .. computed_lens[s] + num_new[s]."""
    context_lens: list[int] = []
    for n, computed in zip(num_new, computed_lens, strict=True):
        context_lens.extend(range(computed + 1, computed + n + 1))
    repeats = torch.tensor(list(num_new), dtype=torch.int64, device=block_tables.device)
    rows = block_tables.repeat_interleave(repeats, dim=0)
    return PagedAttentionMetadata.from_tables([1] * len(context_lens), context_lens, rows, block_size, backend)
