"""Paged KV storage: per layer K and V tensors indexed by block id, sized from a memory budget.

With a layout of several layer groups (cache/kv_layout.py) a block id is a page of one group and
layers at the same place in their groups share one tensor (`keys[l]` is that tensor for layer l).

Layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] (an int8 cache adds an fp16
scale per 16 values: head_dim + head_dim / 8 int8, kernels/kv_int8.py). A token's K/V row for all
heads is contiguous, so storing one new token is a single row write at its slot
(slot = block_id * block_size + offset, viewing the tensor as [num_slots, heads, dim]); attention
kernels read whole blocks through the block table, and gathering a sequence's blocks yields
[tokens, heads, dim] directly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from cache.kv_layout import KVLayout
from kernels.kv_int8 import row_width


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class KVStorage:
    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str = "cpu", layout: KVLayout | None = None,
    ) -> None:
        """`layout`: the layers' groups (None: one group of num_layers layers)."""
        self.layout = layout or KVLayout.single(num_layers)
        if self.layout.num_layers != num_layers:
            raise ValueError(f"a layout of {self.layout.num_layers} layers for a model of {num_layers}")
        shape = (num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype))
        self.num_blocks, self.block_size = num_blocks, block_size
        per_page = self.layout.layers_per_page
        self._key_tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(per_page)]
        self._value_tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(per_page)]
        self.keys = [self._key_tensors[slot] for slot in self.layout.slot_of_layer]
        self.values = [self._value_tensors[slot] for slot in self.layout.slot_of_layer]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block (page) holding num_layers layers (a layout's layers_per_page)."""
        return 2 * num_layers * block_size * num_kv_heads * row_width(head_dim, dtype) * dtype.itemsize

    @classmethod
    def from_budget(
        cls, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device | str = "cpu", budget_bytes: int | None = None, memory_fraction: float | None = None,
        layout: KVLayout | None = None,
    ) -> KVStorage:
        """As many blocks as fit in `budget_bytes`, or in `memory_fraction` of free memory."""
        device = torch.device(device)
        if (budget_bytes is None) == (memory_fraction is None):
            raise ValueError("give exactly one of budget_bytes or memory_fraction")
        if memory_fraction is not None:
            if not 0.0 < memory_fraction <= 1.0:
                raise ValueError("memory_fraction must be in (0, 1]")
            budget_bytes = int(available_memory_bytes(device) * memory_fraction)
        assert budget_bytes is not None  # given, or made from the fraction just above
        per_page = layout.layers_per_page if layout is not None else num_layers
        per_block = cls.bytes_per_block(per_page, block_size, num_kv_heads, head_dim, dtype)
        num_blocks = int(budget_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block ({per_block} bytes each)")
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, layout)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of forked sequences; with
        several groups a page is copied whole, whichever group it serves)."""
        if not copies:
            return
        # pinned + non_blocking on CUDA: no wait for the device's queued steps (kernels/metadata.py `to_device`)
        pinned = self.keys[0].device.type == "cuda"
        src, dst = (torch.tensor(ids, pin_memory=pinned).to(self.keys[0].device, non_blocking=True)
                    for ids in ([s for s, _ in copies], [d for _, d in copies]))
        for tensor in (*self._key_tensors, *self._value_tensors):
            tensor[dst] = tensor[src]


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat slots of token positions [start, end) of a sequence with this block table."""
    return [block_ids[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


def slot_mapping_tensor(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Vectorised slot mapping: block_table [B, max_blocks], positions [B, T] -> slots [B, T]."""
    blocks = torch.gather(block_table, 1, positions // block_size)
    return blocks * block_size + positions % block_size
