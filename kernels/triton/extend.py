"""Triton paged extend attention: prefill of new tokens on top of a cached prefix.

One program per (sequence, query head, tile of BLOCK_M new tokens). The tile's queries sit at
positions prefix + m; the program walks the context through the block table in tiles of BLOCK_N
tokens, from the first key any of its queries can see (0, or the window's start) to the last
(the tile's final position): the cached prefix needs no mask, the new part is masked causally.
Online softmax in fp32; rows with no visible key yet carry m = -inf and weigh nothing.
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
    online_softmax_update,
    tile_dot,
    upcast_dots,
)


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
    scale, window,
    stride_q_token, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_o_token, stride_o_head,
    stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile_m = tl.program_id(2)
    kv_head = head // GROUP
    first_token = tl.load(query_start_ptr + seq)
    num_new = tl.load(query_start_ptr + seq + 1) - first_token
    length = tl.load(context_lens_ptr + seq)
    prefix = length - num_new

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < num_new
    dim_ok = dims < HEAD_DIM
    q_positions = prefix + rows
    q = tl.load(
        q_ptr + (first_token + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )

    # Keys visible to some row of this tile: [lo, hi). An empty tile (past num_new) loops zero times.
    hi = tl.minimum(prefix + (tile_m + 1) * BLOCK_M, length)
    hi = tl.where(tile_m * BLOCK_M < num_new, hi, 0)
    lo = 0
    if window > 0:
        lo = tl.maximum(prefix + tile_m * BLOCK_M - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_table
    for tile in range(lo, hi, BLOCK_N):
        keys_pos = tile + tl.arange(0, BLOCK_N)
        key_ok = keys_pos < hi
        k = load_kv_tile(k_cache_ptr, table_row, keys_pos, key_ok, dims, dim_ok, kv_head,
                         stride_k_block, stride_k_slot, stride_k_head, BLOCK_SIZE, HEAD_DIM, QUANT, BLOCK_N, BLOCK_D)
        v = load_kv_tile(v_cache_ptr, table_row, keys_pos, key_ok, dims, dim_ok, kv_head,
                         stride_v_block, stride_v_slot, stride_v_head, BLOCK_SIZE, HEAD_DIM, QUANT, BLOCK_N, BLOCK_D)
        if QUANT:  # dequantized in fp32, then in q's dtype as a cache of the model's dtype would hold them
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = tile_dot(q, tl.trans(k), PRECISION, UPCAST) * scale
        visible = key_ok[None, :] & (keys_pos[None, :] <= q_positions[:, None])
        if window > 0:
            visible = visible & (keys_pos[None, :] > q_positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(scores, v, m_i, l_i, acc, PRECISION, UPCAST)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (first_token + rows)[:, None] * stride_o_token + head * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start: torch.Tensor, context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.reference.extend_attention`; `max_query_len` spares a device sync."""
    check_last_dim_contiguous(q, k_cache, v_cache)
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max())
    block_m = 64 if max_query_len > 32 else 16
    out = torch.empty_like(q)
    _extend_kernel[(num_seqs, num_q_heads, triton.cdiv(max_query_len, block_m))](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens,
        scale, sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=64, PRECISION=dot_precision(q.dtype), UPCAST=upcast_dots(q.dtype),
        QUANT=is_int8(k_cache),
    )
    return out
