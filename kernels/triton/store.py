"""Triton store_kv: one program per new token copies its K and V rows (all KV heads) to its slot; into an
int8 cache (kernels/kv_int8.py) each head's row is quantized as `kv_int8.quantize` does, per group of KV_GROUP
values: scale = fp16(max|x| / 127), codes round(x / scale) to nearest even from the scale as stored, the fp16
scales after the codes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_int8 import QMAX, is_int8
from kernels.triton.common import KV_GROUP, check_last_dim_contiguous, round_half_even, spread_groups


@triton.jit
def _store_rows(cache_ptr, x, heads, dims, mask, head_ok, HEAD_DIM: tl.constexpr, QUANT: tl.constexpr,
                QMAX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """x [heads, dims] into one token's rows at cache_ptr + heads (head offsets) + dims."""
    if QUANT:
        xf = x.to(tl.float32)
        groups = tl.reshape(tl.abs(xf), [BLOCK_H, BLOCK_D // KV_GROUP, KV_GROUP])  # masked dims were loaded as 0
        scale = tl.math.div_rn(tl.max(groups, 2), QMAX * 1.0).to(tl.float16)  # [heads, groups]
        stored = scale.to(tl.float32)
        safe = tl.where(stored > 0.0, stored, 1.0)  # a group of zeros: codes 0, scale 0
        inverse = tl.where(stored > 0.0, tl.math.div_rn(tl.full(stored.shape, 1.0, tl.float32), safe), 0.0)
        codes = tl.minimum(tl.maximum(round_half_even(xf * spread_groups(inverse, BLOCK_H, BLOCK_D)), -QMAX * 1.0),
                           QMAX * 1.0)
        tl.store(cache_ptr + heads + dims, codes.to(tl.int8), mask=mask)
        group = tl.arange(0, BLOCK_D // KV_GROUP)[None, :]
        scale_ptrs = (cache_ptr + heads + HEAD_DIM).to(tl.pointer_type(tl.float16)) + group  # [heads, groups]
        tl.store(scale_ptrs, scale, mask=head_ok & (group < HEAD_DIM // KV_GROUP))
    else:
        tl.store(cache_ptr + heads + dims, x, mask=mask)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    slots = tl.full([BLOCK_H, BLOCK_D], 0, tl.int64) + slot
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM) & (slots >= 0)  # a negative slot is padding: skip
    head_ok = (heads < NUM_HEADS) & (tl.full([BLOCK_H, 1], 0, tl.int64) + slot >= 0)
    k = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask, other=0.0)
    _store_rows(k_cache_ptr + block * stride_k_block + offset * stride_k_slot, k, heads * stride_k_head, dims, mask,
                head_ok, HEAD_DIM, QUANT, QMAX, BLOCK_H, BLOCK_D)
    _store_rows(v_cache_ptr + block * stride_v_block + offset * stride_v_slot, v, heads * stride_v_head, dims, mask,
                head_ok, HEAD_DIM, QUANT, QMAX, BLOCK_H, BLOCK_D)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as `kernels.reference.store_kv`."""
    check_last_dim_contiguous(key, value, k_cache, v_cache)
    num_tokens, num_heads, head_dim = key.shape
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], QUANT=is_int8(k_cache), QMAX=QMAX,
    )
