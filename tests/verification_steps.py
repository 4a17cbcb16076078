"""One speculative verification step run both ways on the same KV state (the tests of issue 23's
fused verification share it): extend-style (each drafted sequence's k + 1 tokens as one chunk, the
eager path the engine took before) and as one-token decode rows (workers/engine/decode_rows.py, the
fused native decode step)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from cache.kv_storage import KVStorage
from kernels.metadata import PagedAttentionMetadata
from workers.engine import decode_rows
from workers.models import fused_decode
from workers.models.llama import LlamaForCausalLM
from workers.paged_step import run_step


@dataclass
class VerificationRun:
    logits: torch.Tensor  # fp32 [total new tokens, V], every position of the step
    kv: KVStorage  # the caches after the step
    fused: bool  # whether the step took the fused decode path


def verification_both_ways(model: LlamaForCausalLM, prompts: Sequence[Sequence[int]],
                           drafts: Sequence[Sequence[int]], block_size: int = 8,
                           ) -> tuple[VerificationRun, VerificationRun]:
    """(extend-style, decode rows) of one step in which sequence s, having computed prompts[s]
    except its last token, runs that token followed by drafts[s]. Both on the `native` backend."""
    total = sum(len(p) + len(d) for p, d in zip(prompts, drafts, strict=True))
    pool = BlockPool(total // block_size + 2 * len(prompts) + 2, block_size)
    kv = model.allocate_kv(pool.num_blocks, block_size)
    tables = [BlockTable(pool) for _ in prompts]
    run_step(model, kv, tables, [p[:-1] for p in prompts], backend="cpu")
    computed = [t.num_tokens for t in tables]
    steps = [[p[-1], *d] for p, d in zip(prompts, drafts, strict=True)]
    for table, step in zip(tables, steps, strict=True):
        table.append(len(step))
    num_new = [len(s) for s in steps]
    extend = PagedAttentionMetadata.build(num_new, [t.num_tokens for t in tables], [t.block_ids for t in tables],
                                          block_size, backend="native")
    rows = decode_rows.expand(num_new, computed, extend.block_tables, block_size, backend="native")
    input_ids = torch.tensor([tok for s in steps for tok in s], dtype=torch.long)
    runs = []
    for meta in (extend, rows):
        step_kv = model.allocate_kv(pool.num_blocks, block_size)
        for dst, src in zip([*step_kv.keys, *step_kv.values], [*kv.keys, *kv.values], strict=True):
            dst.copy_(src)
        runs.append(VerificationRun(model(input_ids, step_kv, meta), step_kv, fused_decode.can_fuse(model, meta)))
    return runs[0], runs[1]
