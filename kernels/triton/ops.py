"""The Triton backend as the dispatch sees it: store_kv plus the decode and extend steps."""

from __future__ import annotations

import torch

from kernels.metadata import PagedAttentionMetadata
from kernels.triton.decode import decode_attention
from kernels.triton.extend import extend_attention
from kernels.triton.store import store_kv

__all__ = ["decode_step", "extend_step", "store_kv"]


def decode_step(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata, scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    d = meta.num_decodes
    return decode_attention(
        q, k_cache, v_cache, meta.block_tables[:d], meta.context_lens[:d], scale, sliding_window,
        max_context=max(meta.context_lens_list[:d]),
    )


def extend_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: PagedAttentionMetadata, scale: float, sliding_window: int | None,
) -> torch.Tensor:
    query_start, context_lens, block_tables = meta.extend_part()
    return extend_attention(
        q, k_cache, v_cache, block_tables, query_start, context_lens, scale, sliding_window,
        max_query_len=max(meta.query_lens_list[meta.num_decodes :]),
    )
