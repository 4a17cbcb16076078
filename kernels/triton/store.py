"""Triton store_kv: one program per new token copies its K and V rows (all KV heads) to its slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import check_last_dim_contiguous


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    slots = tl.full([BLOCK_H, BLOCK_D], 0, tl.int64) + slot
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM) & (slots >= 0)  # a negative slot is padding: skip
    k = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask)
    tl.store(k_cache_ptr + block * stride_k_block + offset * stride_k_slot + heads * stride_k_head + dims, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_v_block + offset * stride_v_slot + heads * stride_v_head + dims, v, mask=mask)


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
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )
