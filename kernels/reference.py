"""Torch reference for the paged ops: slow, short, obviously correct; the yardstick for the others.

Shapes shared by every backend:
- K/V cache per layer: [num_blocks, block_size, num_kv_heads, head_dim] (head_dim + 4 in an int8 cache:
  kernels/kv_int8.py);
- store_kv: key/value [N, Hkv, D] written at flat slots [N] (a negative slot is skipped);
- decode_attention: q [B, Hq, D], one new token per sequence whose K/V is already stored;
- extend_attention: q [N, Hq, D] packed by `query_start`; each sequence's new tokens (already
  stored) sit at the end of its context, attend causally among themselves and fully to its prefix.
A query at position p sees keys at positions k <= p, and k > p - window with a sliding window.
Query head h reads KV head h // (Hq // Hkv). Scores, softmax and sums run in fp32.
With `softcap` c (Gemma 2), scaled scores s become c * tanh(s / c) before masking; only this
reference implements it, so `dispatch.paged_attention` sends soft-capped attention here.
"""

from __future__ import annotations

import torch

from kernels.kv_int8 import dequantize, is_int8, narrow
from kernels.metadata import PagedAttentionMetadata


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    block_size = k_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = narrow(key[token], k_cache)
            v_cache[slot // block_size, slot % block_size] = narrow(value[token], v_cache)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence as [length, Hkv, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    blocks = block_table[positions // block_size].long()
    rows = cache[blocks, positions % block_size]
    return dequantize(rows, torch.float32) if is_int8(cache) else rows


def attend_one_sequence(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_positions: torch.Tensor, scale: float,
    sliding_window: int | None, softcap: float | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] at q_positions [T] over keys/values [L, Hkv, D] at positions 0..L-1."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_positions = torch.arange(keys.shape[0], device=q.device)
    visible = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        visible &= k_positions[None, :] > q_positions[:, None] - sliding_window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    out = torch.einsum("htl,lhd->thd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    for seq, length in enumerate(context_lens.tolist()):
        keys = gather_context(k_cache, block_tables[seq], length)
        values = gather_context(v_cache, block_tables[seq], length)
        position = torch.tensor([length - 1], device=q.device)
        out[seq] = attend_one_sequence(q[seq : seq + 1], keys, values, position, scale, sliding_window,
                                       softcap)[0]
    return out


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start: torch.Tensor, context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    starts = query_start.tolist()
    for seq, length in enumerate(context_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        keys = gather_context(k_cache, block_tables[seq], length)
        values = gather_context(v_cache, block_tables[seq], length)
        q_positions = torch.arange(length - (end - begin), length, device=q.device)
        out[begin:end] = attend_one_sequence(q[begin:end], keys, values, q_positions, scale, sliding_window,
                                                 softcap)
    return out


def decode_step(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata, scale: float,
    sliding_window: int | None, softcap: float | None = None,
) -> torch.Tensor:
    d = meta.num_decodes
    return decode_attention(q, k_cache, v_cache, meta.block_tables[:d], meta.context_lens[:d], scale, sliding_window,
                            softcap)


def extend_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: PagedAttentionMetadata, scale: float, sliding_window: int | None, softcap: float | None = None,
) -> torch.Tensor:
    query_start, context_lens, block_tables = meta.extend_part()
    return extend_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, sliding_window,
                            softcap)
