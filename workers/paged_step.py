"""Run one model step for sequences that each own a block table: the minimal paged runner.

Offline generation, tests and benchmarks use it; the engine's runner builds the same metadata
from its scheduler's batch. Sequences that each get one token should come first (decode kernel).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from cache.kv_storage import KVStorage
from kernels.metadata import Backend, PagedAttentionMetadata
from workers.models.llama import LlamaForCausalLM


def run_step(
    model: LlamaForCausalLM,
    kv: KVStorage,
    tables: Sequence[BlockTable],
    new_tokens: Sequence[Sequence[int]],
    all_logits: bool = False,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Append each sequence's new tokens, run them; logits of each sequence's last new token [S, V]
    (or of every new token [N, V] with all_logits). Attention runs on `backend` (None: by device).
    Raises OutOfBlocksError when blocks run out."""
    for table, tokens in zip(tables, new_tokens, strict=True):
        kv.copy_blocks(table.append(len(tokens)))
    meta = PagedAttentionMetadata.build(
        [len(t) for t in new_tokens], [t.num_tokens for t in tables], [t.block_ids for t in tables],
        kv.block_size, model.device, backend=backend,
    )
    input_ids = torch.tensor([tok for tokens in new_tokens for tok in tokens], dtype=torch.long, device=model.device)
    last = None if all_logits else (meta.query_start[1:] - 1).long()
    return model(input_ids, kv, meta, last)


def prefill_logits(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]], block_size: int = 16) -> torch.Tensor:
    """Logits of every token of equal-length prompts run together in one step on fresh KV: [B, T, V]."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("prompts must have equal lengths")
    blocks_each = -(-len(prompts[0]) // block_size)
    pool = BlockPool(blocks_each * len(prompts), block_size)
    kv = model.allocate_kv(pool.num_blocks, block_size)
    logits = run_step(model, kv, [BlockTable(pool) for _ in prompts], prompts, all_logits=True)
    return logits.view(len(prompts), len(prompts[0]), -1)
