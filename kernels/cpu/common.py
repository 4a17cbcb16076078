"""Pieces shared by the CPU attention paths: additive visibility masks and block gathers."""

from __future__ import annotations

import torch


def visibility_mask(
    key_positions: torch.Tensor, query_positions: torch.Tensor, key_count: torch.Tensor | int,
    sliding_window: int | None, dtype: torch.dtype,
) -> torch.Tensor:
    """Additive mask (0 = attend, -inf = hidden), broadcast over [..., queries, keys]."""
    visible = (key_positions <= query_positions) & (key_positions < key_count)
    if sliding_window is not None:
        visible &= key_positions > query_positions - sliding_window
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


class GatherBuffers:
    """Gather targets for K and V reused by every layer of a step: a fresh multi-MB tensor per
    layer costs page faults that can take longer than the copy itself."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The listed blocks of both caches, in order, as [len(block_index), block_size, Hkv, D]."""
        shape = (block_index.shape[0], *k_cache.shape[1:])
        if self.keys is None or self.keys.shape != shape or self.keys.dtype != k_cache.dtype:
            self.keys = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
            self.values = torch.empty_like(self.keys)
        assert self.values is not None
        torch.index_select(k_cache, 0, block_index, out=self.keys)
        torch.index_select(v_cache, 0, block_index, out=self.values)
        return self.keys, self.values


def per_sequence(blocks: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[num_seqs * n, block_size, Hkv, D] gathered blocks -> [num_seqs, Hkv, n * block_size, D] (a view)."""
    return blocks.view(num_seqs, -1, *blocks.shape[2:]).transpose(1, 2)
