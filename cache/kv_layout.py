"""How a model's layers share KV pages: one block table per layer group, one page pool for all.

A model whose layers all see the same keys (every layer full, or every layer the same sliding
window) has one group: a block id then names one block of every layer, as it always did. A model
that mixes windows (Gemma 2/3: sliding layers and full ones) cannot give back a sliding layer's
old blocks while its full layers still need the same ids, so its layers are split into groups of
`layers_per_page` layers of one window each, and every sequence has one block table per group
(vLLM's hybrid allocator is the idea). A page is `block_size` tokens of `layers_per_page` layers;
all groups draw pages from the same pool, so memory a sliding group gives back serves any group.

Storage: `layers_per_page` K (and V) tensors of [num_pages, block_size, heads, dim]; layer l lives
in tensor `slot_of_layer[l]` (its place within its group) at its group's pages. Groups of one kind
(same window) hold the same positions; group 0 is one with the widest window (a full one when
any), so a position whose group-0 page is gone has no page in any group either (the prefix tree
keys its paths by group 0's pages and carries the others as companions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    layers_per_page: int
    group_windows: tuple[int | None, ...]  # per group: its layers' sliding window, None = full
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]  # the storage tensor of each layer: its index within its group

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_layers(self) -> int:
        return len(self.group_of_layer)

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVLayout:
        """Every layer in one group (one table per sequence): layers with one window, or a layout
        that gives nothing back early."""
        return cls(num_layers, (window,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def for_windows(cls, layer_windows: Sequence[int | None]) -> KVLayout:
        """Groups for these per-layer windows: one group when all are equal, otherwise groups of
        as many layers as the rarest window has (the last group of a window may be partly empty)."""
        if len(set(layer_windows)) <= 1:
            return cls.single(len(layer_windows), layer_windows[0] if layer_windows else None)
        # Widest window first (None = full attention): group 0 then outlives every other group's pages.
        kinds = sorted(set(layer_windows), key=lambda w: -(w if w is not None else float("inf")))
        members = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
        per_page = min(len(m) for m in members.values())
        windows: list[int | None] = []
        group_of, slot_of = [0] * len(layer_windows), [0] * len(layer_windows)
        for w in kinds:
            for start in range(0, len(members[w]), per_page):
                for slot, layer in enumerate(members[w][start : start + per_page]):
                    group_of[layer], slot_of[layer] = len(windows), slot
                windows.append(w)
        return cls(per_page, tuple(windows), tuple(group_of), tuple(slot_of))
