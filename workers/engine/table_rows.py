"""Persistent block-table rows: the running sequences' block tables mirrored in one int32 tensor
that lives across steps, so a step's `block_tables` is one `index_select`, not a tensor built from
Python lists per sequence.

Each BlockTable (by identity) owns one row while it lives; the row is rewritten only when the
table's `version` moved since it was last copied (a decode crosses into a new block once every
block_size steps), and freed when the table object is collected. Invariant: for every live
mirrored table, row[:len(block_ids)] == block_ids as of its recorded version; entries past it are
0 (a valid block id, so a kernel that reads a padded entry reads real memory), and so are the
slots a sliding window dropped (`NO_BLOCK`): a kernel that reads them masks what it read.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cache.block_table import BlockTable
from kernels.cpu import native
from kernels.metadata import Backend, PagedAttentionMetadata, table_row, to_device


@dataclass
class _Mirror:
    row: int
    version: int
    num_blocks: int


class BlockTableRows:
    def __init__(self, device: torch.device | str = "cpu", rows: int = 64, width: int = 64) -> None:
        self.rows = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self._mirrors: weakref.WeakKeyDictionary[BlockTable, _Mirror] = weakref.WeakKeyDictionary()
        self._free = list(range(rows - 1, -1, -1))
        self.num_rewrites = 0  # rows written since creation (tests and benches read it)

    def gather(self, tables: Sequence[BlockTable]) -> torch.Tensor:
        """The tables' rows, in order, as a fresh int32 tensor [len(tables), max blocks among them]."""
        indices, width = self._synced(tables)
        index = to_device(indices, torch.int64, self.rows.device)
        return self.rows[:, :width].index_select(0, index)

    def decode_metadata(self, tables: Sequence[BlockTable], context_lens: list[int], block_size: int,
                        backend: Backend | None) -> PagedAttentionMetadata:
        """An all-decode step over `tables` (one new token each, `context_lens` after it): what
        `PagedAttentionMetadata.from_tables(..., self.gather(tables), ...)` gives, in one native call on
        a CPU whose native ops are loaded (decode_metadata.cpp: the step's metadata cost ~0.5 ms there)."""
        if self.rows.device.type != "cpu" or not native.is_loaded():
            return PagedAttentionMetadata.from_tables([1] * len(tables), context_lens, self.gather(tables),
                                                      block_size, backend=backend)
        indices, width = self._synced(tables)
        block_tables, lens, positions, slots, query_start = torch.ops.tollway_cpu.decode_metadata(
            self.rows, indices, context_lens, width, block_size)
        return PagedAttentionMetadata(query_start=query_start, context_lens=lens, block_tables=block_tables,
                                      slot_mapping=slots, positions=positions, block_size=block_size,
                                      num_decodes=len(tables), query_lens_list=[1] * len(tables),
                                      context_lens_list=context_lens, backend=backend)

    def _synced(self, tables: Sequence[BlockTable]) -> tuple[list[int], int]:
        """The tables' row indices (each row brought up to date) and the widest table's block count."""
        return [self._sync(table) for table in tables], max(len(t.block_ids) for t in tables)

    def _sync(self, table: BlockTable) -> int:
        mirror = self._mirrors.get(table)
        if mirror is None:
            mirror = self._mirrors[table] = _Mirror(self._take_row(), -1, 0)
            weakref.finalize(table, self._free.append, mirror.row)
        if mirror.version != table.version:
            blocks = table.block_ids
            if len(blocks) > self.rows.shape[1]:
                self._grow(rows=self.rows.shape[0], width=max(len(blocks), 2 * self.rows.shape[1]))
            row = self.rows[mirror.row]
            row[: len(blocks)] = table_row(blocks, row.device)  # NO_BLOCK slots read block 0
            row[len(blocks) : mirror.num_blocks] = 0
            mirror.version, mirror.num_blocks = table.version, len(blocks)
            self.num_rewrites += 1
        return mirror.row

    def _take_row(self) -> int:
        if not self._free:
            old = self.rows.shape[0]
            self._grow(rows=2 * old, width=self.rows.shape[1])
            self._free.extend(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _grow(self, rows: int, width: int) -> None:
        grown = torch.zeros(rows, width, dtype=torch.int32, device=self.rows.device)
        grown[: self.rows.shape[0], : self.rows.shape[1]] = self.rows
        self.rows = grown
