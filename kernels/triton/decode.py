"""Triton paged decode attention as flash-decoding.

Stage 1: one program per (sequence, KV head, split); a split is a run of `split_len` context
tokens. The program loads the query heads that share its KV head as the rows of one tile (GQA:
each K/V tile is read once for the whole group), walks its split through the block table in
tiles of BLOCK_N tokens with an online softmax, and writes its normalised partial output and its
log-sum-exp. Stage 2: one program per (sequence, query head) merges the splits by their LSEs.
A split with no visible key writes LSE = -inf and weighs nothing in the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_int8 import is_int8
from kernels.triton.common import (
    check_last_dim_contiguous,
    dot_precision,
    load_kv_tile,
    multiprocessor_count,
    online_softmax_update,
    tile_dot,
    upcast_dots,
)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, part_out_ptr, part_lse_ptr,
    scale, window, split_len,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_table,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )

    start = split * split_len
    end = tl.minimum(start + split_len, length)
    if window > 0:
        start = tl.maximum(start, length - window)  # the query sits at position length - 1
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_table
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        token_ok = tokens < end
        k = load_kv_tile(k_cache_ptr, table_row, tokens, token_ok, dims, dim_ok, kv_head,
                         stride_k_block, stride_k_slot, stride_k_head, BLOCK_SIZE, HEAD_DIM, QUANT, BLOCK_N, BLOCK_D)
        v = load_kv_tile(v_cache_ptr, table_row, tokens, token_ok, dims, dim_ok, kv_head,
                         stride_v_block, stride_v_slot, stride_v_head, BLOCK_SIZE, HEAD_DIM, QUANT, BLOCK_N, BLOCK_D)
        if QUANT:  # dequantized in fp32, then in q's dtype as a cache of the model's dtype would hold them
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = tile_dot(q, tl.trans(k), PRECISION, UPCAST) * scale
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(scores, v, m_i, l_i, acc, PRECISION, UPCAST)

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(
        part_out_ptr + seq * stride_po_seq + heads[:, None] * stride_po_head + split * stride_po_split + dims[None, :],
        out, mask=row_ok[:, None] & dim_ok[None, :],
    )
    tl.store(part_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + split, lse, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    stride_o_seq, stride_o_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    lse = tl.load(part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + splits, mask=split_ok,
                  other=float("-inf"))
    top = tl.max(lse, 0)
    weights = tl.exp(lse - top)
    parts = tl.load(
        part_out_ptr + seq * stride_po_seq + head * stride_po_head + splits[:, None] * stride_po_split + dims[None, :],
        mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def choose_split_len(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Tokens per split: enough programs to fill the GPU ~4 times over, splits of >= 256 tokens."""
    wanted_programs = 4 * multiprocessor_count(device)
    splits = max(1, -(-wanted_programs // (num_seqs * num_kv_heads)))
    split_len = max(256, -(-max_context // splits))
    return -(-split_len // block_n) * block_n


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    max_context: int | None = None, split_len: int | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.reference.decode_attention`; `max_context` spares a device sync."""
    check_last_dim_contiguous(q, k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    block_n = 64  # tokens per tile; any block size works, each token finds its block in the table
    if max_context is None:
        max_context = int(context_lens.max())
    if split_len is None:
        split_len = choose_split_len(batch, num_kv_heads, max_context, block_n, q.device)
    num_splits = -(-max_context // split_len)
    group = num_q_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    part_out = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse,
        scale, sliding_window or 0, split_len,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), UPCAST=upcast_dots(q.dtype),
        QUANT=is_int8(k_cache),
    )
    out = torch.empty_like(q)
    _decode_merge_kernel[(batch, num_q_heads)](
        part_out, part_lse, out, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )
    return out
