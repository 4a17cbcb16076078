"""Batch-size buckets for captured decode steps (CUDA graphs; a compiled step would use the same).

A captured step has fixed shapes, so decode batches are padded up to the nearest bucket, and a
batch larger than the largest bucket runs eagerly. Padding rows are dummy sequences: token 0 at
position 0, one context token, whose block table is the single `dummy_block` (a block the caller
reserves and no sequence ever owns) and whose K/V slot is that block's first slot. They write and
read only the dummy block, so real rows' results are those of the unpadded batch; their logits are
dropped. Context lengths are bucketed too (powers of two), because a kernel's launch grid may
depend on the longest context (kernels/triton/decode.py splits it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.metadata import Backend, PagedAttentionMetadata

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
MIN_CONTEXT_BUCKET = 256


def batch_bucket(batch: int, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> int | None:
    """The smallest bucket holding `batch` sequences; None: run eagerly (beyond the largest)."""
    for size in sorted(buckets):
        if size >= batch:
            return size
    return None


def context_bucket(max_context: int) -> int:
    """The power of two (at least MIN_CONTEXT_BUCKET) holding the step's longest context."""
    bucket = MIN_CONTEXT_BUCKET
    while bucket < max_context:
        bucket *= 2
    return bucket


@dataclass
class PaddedDecode:
    input_ids: torch.Tensor  # [bucket] int64
    meta: PagedAttentionMetadata  # bucket sequences, one new token each
    num_real: int  # the first num_real rows are the batch's; the rest are dummies


def pad_decode_batch(
    input_ids: torch.Tensor, meta: PagedAttentionMetadata, bucket: int, dummy_block: int,
    backend: Backend | None = None,
) -> PaddedDecode:
    """The decode step `meta` (every sequence one new token) padded with dummy rows to `bucket`."""
    batch = meta.num_seqs
    if meta.num_decodes != batch:
        raise ValueError("only all-decode steps are padded to a bucket")
    if bucket < batch:
        raise ValueError(f"a bucket of {bucket} cannot hold {batch} sequences")
    pad = bucket - batch
    device = input_ids.device

    def padded_tables(rows: torch.Tensor) -> torch.Tensor:
        tables = torch.zeros(bucket, rows.shape[1], dtype=torch.int32, device=device)
        tables[:batch] = rows
        tables[batch:, 0] = dummy_block
        return tables

    def extended(values: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([values, values.new_full((pad,), fill)])

    # The step's own tensors extended on the device (no second build from host lists, no host->device copy):
    # a dummy row is token 0 at position 0 with one context token, in the dummy block's first slot.
    padded = PagedAttentionMetadata(
        query_start=torch.arange(bucket + 1, dtype=torch.int32, device=device),
        context_lens=extended(meta.context_lens, 1), block_tables=padded_tables(meta.block_tables),
        slot_mapping=extended(meta.slot_mapping, dummy_block * meta.block_size), positions=extended(meta.positions, 0),
        block_size=meta.block_size, num_decodes=bucket, query_lens_list=[1] * bucket,
        context_lens_list=[*meta.context_lens_list, *([1] * pad)], backend=backend)
    # Layer groups (cache/kv_layout.py): each group's tables padded alike; the dummy block is a page of any group.
    padded.other_groups = [padded.with_tables(padded_tables(g.block_tables)) for g in meta.other_groups]
    return PaddedDecode(extended(input_ids, 0), padded, batch)
