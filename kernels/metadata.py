"""What paged attention needs to know about one forward step, built once and shared by all layers.

A step runs a flat batch of N new tokens from S sequences. Sequence s owns tokens
[query_start[s], query_start[s + 1]) of the flat batch; its K/V (cached prefix and new tokens) live
in the blocks of row s of `block_tables`, and after this step it holds `context_lens[s]` tokens, so
its new tokens sit at positions [context_lens[s] - query_len, context_lens[s]).

Invariant: the first `num_decodes` sequences have exactly one new token each (they go to the
decode kernel); the rest go to the extend kernel. `build` counts the leading one-token sequences,
so callers that want decode speed put decodes first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

Backend = Literal["reference", "cpu", "native", "triton"]
BACKENDS: tuple[Backend, ...] = ("reference", "cpu", "native", "triton")


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device`, copied without waiting for the device's queued work: a plain
    `torch.tensor(..., device=cuda)` copies from pageable memory and synchronizes the stream first, so an
    overlapped step (workers/engine/overlap.py) would wait for the step before it to finish before it
    could launch. On CUDA the list is staged in pinned memory (torch's caching host allocator keeps the
    buffer until the copy is done) and copied asynchronously; elsewhere it is the tensor itself."""
    if torch.device(device).type != "cuda":
        return torch.tensor(list(values), dtype=dtype, device=device)
    return torch.tensor(list(values), dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def table_row(block_ids: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """A sequence's block ids as an int32 row of a block-table tensor on `device`. A slot a sliding window
    gave back (a negative id, cache.block_table.NO_BLOCK) reads block 0, real memory that the kernels mask."""
    return to_device([max(b, 0) for b in block_ids], torch.int32, device)


@dataclass
class PagedAttentionMetadata:
    query_start: torch.Tensor  # [S + 1] int32, cumulative new-token counts
    context_lens: torch.Tensor  # [S] int32, tokens held after this step (prefix + new)
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0 past each sequence's blocks
    slot_mapping: torch.Tensor  # [N] int64, flat slot (block * block_size + offset) of each new token
    positions: torch.Tensor  # [N] int64, absolute position of each new token
    block_size: int
    num_decodes: int
    query_lens_list: list[int]
    context_lens_list: list[int]
    # The backend that runs this step (kernels/dispatch.py); None: chosen by device by the first layer.
    backend: Backend | None = None
    # Per-step preparations of a backend (gather indices, masks), keyed by backend and dtype and
    # made by the first layer that needs them; owned by the backend that wrote them.
    prepared: dict[object, object] = field(default_factory=dict)
    # Python rows of `block_tables` for the backends that plan in Python (the CPU cascade); made from
    # the tensor on first use when the step was built from tensors (`from_tables`).
    tables_as_lists: list[list[int]] | None = None
    # With several layer groups (cache/kv_layout.py): the step as groups 1.. see it, their own
    # block tables and slots (same tokens, positions and lengths); empty with one group.
    other_groups: list[PagedAttentionMetadata] = field(default_factory=list)

    def for_group(self, group: int) -> PagedAttentionMetadata:
        """The step as the layers of `group` see it (their pages)."""
        return self if group == 0 else self.other_groups[group - 1]

    def seq_of_token(self) -> torch.Tensor:
        """[N] int64: the sequence each new token belongs to."""
        seq_of_token = torch.arange(self.num_seqs, device=self.block_tables.device)
        if self.num_decodes != self.num_seqs:  # (all decodes: token i is sequence i's, no host sync)
            seq_of_token = torch.repeat_interleave(seq_of_token, self.query_start[1:] - self.query_start[:-1],
                                                   output_size=sum(self.query_lens_list))
        return seq_of_token

    def with_tables(self, block_tables: torch.Tensor) -> PagedAttentionMetadata:
        """The same step over another group's block tables [S, max_blocks] (rows as in `from_tables`)."""
        token_blocks = block_tables[self.seq_of_token(), self.positions // self.block_size].long()
        return PagedAttentionMetadata(
            query_start=self.query_start, context_lens=self.context_lens, block_tables=block_tables,
            slot_mapping=token_blocks * self.block_size + self.positions % self.block_size,
            positions=self.positions, block_size=self.block_size, num_decodes=self.num_decodes,
            query_lens_list=self.query_lens_list, context_lens_list=self.context_lens_list, backend=self.backend,
        )

    @property
    def block_tables_list(self) -> list[list[int]]:
        """Each sequence's blocks as a list (those covering its context)."""
        if self.tables_as_lists is None:
            bs = self.block_size
            rows = self.block_tables.tolist()
            self.tables_as_lists = [row[: -(-n // bs)] for row, n in zip(rows, self.context_lens_list, strict=True)]
        return self.tables_as_lists

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_list, default=0)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        backend: Backend | None = None,
    ) -> PagedAttentionMetadata:
        if not (len(query_lens) == len(context_lens) == len(block_tables)) or not query_lens:
            raise ValueError("need one query length, context length and block table per sequence (at least one)")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block size must be a power of two, got {block_size}")
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            if not 1 <= q_len <= ctx:
                raise ValueError(f"a sequence needs 1 <= new tokens ({q_len}) <= context length ({ctx})")
            if len(table) * block_size < ctx:
                raise ValueError(f"{len(table)} blocks of {block_size} cannot hold {ctx} tokens")
        max_blocks = max(len(t) for t in block_tables)
        padded = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
        for row, blocks in enumerate(block_tables):
            padded[row, : len(blocks)] = table_row(blocks)
        meta = cls.from_tables(query_lens, context_lens, padded.to(device), block_size, backend)
        meta.tables_as_lists = [[max(b, 0) for b in t] for t in block_tables]
        return meta

    @classmethod
    def from_tables(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: torch.Tensor,
        block_size: int,
        backend: Backend | None = None,
    ) -> PagedAttentionMetadata:
        """A step over block tables already laid out as an int32 tensor [S, max_blocks] on the step's
        device (rows padded past each sequence's blocks with any valid block id). Positions and slots
        come from tensor ops: the Python work is O(S), never O(S x blocks). Not validated: the
        caller (the engine's runner, `build`) guarantees lengths and tables agree."""
        device = block_tables.device
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        q_lens = to_device(query_lens, torch.int64, device)
        ctx_lens = to_device(context_lens, torch.int64, device)
        query_start = torch.zeros(len(query_lens) + 1, dtype=torch.int64, device=device)
        torch.cumsum(q_lens, 0, out=query_start[1:])
        if num_decodes == len(query_lens):  # all decodes: token i is sequence i's newest
            seq_of_token = torch.arange(len(query_lens), device=device)
            positions = ctx_lens - 1
        else:
            seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens), device=device), q_lens,
                                                   output_size=sum(query_lens))  # known here: no device sync
            first = (ctx_lens - q_lens - query_start[:-1])[seq_of_token]
            positions = torch.arange(len(seq_of_token), device=device) + first
        # one flat index_select: advanced indexing with two index tensors cost ~10x it in a decode step
        flat = seq_of_token * block_tables.shape[1] + positions // block_size
        token_blocks = block_tables.reshape(-1).index_select(0, flat).long()
        slots = token_blocks * block_size + positions % block_size
        return cls(
            query_start=query_start.to(torch.int32),
            context_lens=ctx_lens.to(torch.int32),
            block_tables=block_tables,
            slot_mapping=slots,
            positions=positions,
            block_size=block_size,
            num_decodes=num_decodes,
            query_lens_list=list(query_lens),
            context_lens_list=list(context_lens),
            backend=backend,
        )

    def extend_part(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query_start rebased to 0, context_lens, block_tables) of the sequences after the decodes."""
        d = self.num_decodes
        return self.query_start[d:] - self.query_start[d], self.context_lens[d:], self.block_tables[d:]
