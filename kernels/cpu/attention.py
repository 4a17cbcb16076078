"""The CPU path: paged attention from batched torch ops, the engine's default off CUDA.

Decode gathers every sequence's blocks with one `index_select` per tensor into [B, L, Hkv, D]
(L = the longest context rounded up to whole blocks) and runs one `scaled_dot_product_attention`
over the batch, with the query heads of each KV head as that head's query rows (no K/V repeat for
GQA) and an additive mask hiding keys past each sequence's length (or outside its window).
Extend runs one SDPA per sequence: a sequence with no cached prefix attends over its new K/V as
they are (plain causal), one with a prefix over its gathered context with an offset causal mask.
`decode_step` reads a prefix shared by a group of decodes once (cascade.py) when there is one.
`store_kv`, `decode_step` and `extend_step` are the backend interface the dispatch calls.

Gather indices and masks depend only on the step, so they are built by the first layer and kept
in `PagedAttentionMetadata.prepared` for the others (see `prepare_decode`, `prepare_extend`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cpu.cascade import CascadePlan, cascade_decode, plan_cascade
from kernels.cpu.common import GatherBuffers, per_sequence, visibility_mask
from kernels.kv_int8 import as_stored, narrow, widen
from kernels.metadata import PagedAttentionMetadata


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [N, Hkv, D] at their flat slots (every slot must be valid, i.e. >= 0), rounded
    to the caches' dtype when it is narrower than theirs, or quantized (`TOLLWAY_KV_CACHE_DTYPE`)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, narrow(key, k_cache))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, narrow(value, v_cache))


@dataclass
class DecodePlan:
    block_index: torch.Tensor  # [B * blocks per sequence] int64, block ids in sequence order
    mask: torch.Tensor | None  # [B, 1, 1, L] additive; None when every sequence fills all L keys
    buffers: GatherBuffers = field(default_factory=GatherBuffers)


def prepare_decode(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, dtype: torch.dtype,
    sliding_window: int | None,
) -> DecodePlan:
    lengths = context_lens.long()
    max_len = int(lengths.max())
    blocks_per_seq = -(-max_len // block_size)
    block_index = block_tables[:, :blocks_per_seq].reshape(-1).long()
    num_keys = blocks_per_seq * block_size
    mask = None
    if bool((lengths != num_keys).any()) or (sliding_window is not None and max_len > sliding_window):
        key_positions = torch.arange(num_keys, device=lengths.device)
        query_positions = (lengths - 1)[:, None]
        mask = visibility_mask(key_positions[None, :], query_positions, lengths[:, None], sliding_window, dtype)
        mask = mask[:, None, None, :]
    return DecodePlan(block_index, mask)


def gather_blocks(cache: torch.Tensor, block_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[num_seqs, blocks * block_size, Hkv, D] from the listed blocks, in order."""
    gathered = cache.index_select(0, block_index)
    return gathered.view(num_seqs, -1, *cache.shape[2:])


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, sliding_window: int | None = None, plan: DecodePlan | None = None,
) -> torch.Tensor:
    if plan is None:
        plan = prepare_decode(block_tables, context_lens, k_cache.shape[1], q.dtype, sliding_window)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys, values = plan.buffers.gather(k_cache, v_cache, plan.block_index)
    keys, values = per_sequence(widen(keys, q.dtype), batch), per_sequence(widen(values, q.dtype), batch)  # [B, Hkv, L, D]
    grouped = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


@dataclass(frozen=True)
class ExtendSequence:
    index: int  # row in the block tables
    begin: int  # first new token in the flat batch
    end: int
    length: int  # context length after the step
    block_index: torch.Tensor | None  # blocks of the whole context; None = no prefix, attend new K/V only
    mask: torch.Tensor | None  # [T, context] additive, for sequences with a prefix


def prepare_extend(
    block_tables: torch.Tensor, query_start: list[int], context_lens: list[int], block_size: int,
    dtype: torch.dtype, sliding_window: int | None,
) -> list[ExtendSequence]:
    plan = []
    for seq, length in enumerate(context_lens):
        begin, end = query_start[seq], query_start[seq + 1]
        num_new = end - begin
        fresh = num_new == length and (sliding_window is None or num_new <= sliding_window)
        if fresh:
            plan.append(ExtendSequence(seq, begin, end, length, None, None))
            continue
        num_blocks = -(-length // block_size)
        key_positions = torch.arange(length, device=block_tables.device)
        query_positions = torch.arange(length - num_new, length, device=block_tables.device)[:, None]
        mask = visibility_mask(key_positions[None, :], query_positions, length, sliding_window, dtype)
        plan.append(ExtendSequence(seq, begin, end, length, block_tables[seq, :num_blocks].long(), mask))
    return plan


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start: torch.Tensor, context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    plan: list[ExtendSequence] | None = None, new_keys: torch.Tensor | None = None,
    new_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """As the reference; `new_keys`/`new_values` ([N, Hkv, D], the K/V just stored) let sequences
    without a prefix skip the gather."""
    if plan is None:
        plan = prepare_extend(
            block_tables, query_start.tolist(), context_lens.tolist(), k_cache.shape[1], q.dtype, sliding_window
        )
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    for seq in plan:
        queries = q[seq.begin : seq.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
        if seq.block_index is None and new_keys is not None and new_values is not None:
            # as stored: a narrower cache rounds them, and a later prefix hit must read the same values
            keys = as_stored(new_keys[seq.begin : seq.end], k_cache).transpose(0, 1).unsqueeze(0)
            values = as_stored(new_values[seq.begin : seq.end], v_cache).transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            block_index = seq.block_index
            if block_index is None:  # fresh sequence but no new K/V given: read them back from the cache
                block_index = block_tables[seq.index, : -(-seq.length // k_cache.shape[1])].long()
            keys = widen(gather_blocks(k_cache, block_index, 1)[:, : seq.length], q.dtype).transpose(1, 2)
            values = widen(gather_blocks(v_cache, block_index, 1)[:, : seq.length], q.dtype).transpose(1, 2)
            mask = seq.mask
            attn = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
            )
        out[seq.begin : seq.end] = attn[0].transpose(0, 1)
    return out


def decode_step(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata, scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    d = meta.num_decodes
    if sliding_window is None:  # a window would cut into the shared prefix: plain path then
        cascade_key = ("cpu-cascade", q.dtype)
        if cascade_key not in meta.prepared:
            meta.prepared[cascade_key] = plan_cascade(
                meta.block_tables_list[:d], meta.context_lens_list[:d], meta.block_size, q.dtype, q.device)
        cascade = meta.prepared[cascade_key]  # None: no shared prefix this step
        if isinstance(cascade, CascadePlan):
            return cascade_decode(q, k_cache, v_cache, cascade, scale)
    key = ("cpu-decode", q.dtype, sliding_window)
    plan = meta.prepared.get(key)
    if not isinstance(plan, DecodePlan):  # not prepared yet by an earlier layer
        plan = meta.prepared[key] = prepare_decode(
            meta.block_tables[:d], meta.context_lens[:d], meta.block_size, q.dtype, sliding_window
        )
    return decode_attention(q, k_cache, v_cache, meta.block_tables[:d], meta.context_lens[:d], scale,
                            sliding_window, plan=plan)


def extend_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: PagedAttentionMetadata, scale: float, sliding_window: int | None,
) -> torch.Tensor:
    query_start, context_lens, block_tables = meta.extend_part()
    key = ("cpu-extend", q.dtype, sliding_window)
    plan = meta.prepared.get(key)
    if not isinstance(plan, list):  # not prepared yet by an earlier layer
        plan = meta.prepared[key] = prepare_extend(
            block_tables, query_start.tolist(), meta.context_lens_list[meta.num_decodes :], meta.block_size,
            q.dtype, sliding_window,
        )
    return extend_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, sliding_window,
                            plan=plan, new_keys=k, new_values=v)
