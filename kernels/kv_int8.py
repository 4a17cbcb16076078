"""The int8 KV cache (`TOLLWAY_KV_CACHE_DTYPE=int8`, CPU and GPU): each token's K (or V) row of one head is kept as
head_dim int8 codes followed by one fp16 scale per group of 16 values, in one int8 tensor
[num_blocks, block_size, Hkv, D + D / 8] (72 bytes for 64 values).

A group x of 16 values is stored as q = round(x / s) with s = fp16(max|x| / 127) (q in [-127, 127]; the code is
computed from the fp16 scale, so q * s is what every read gives back; a group of zeros has s = 0). llama.cpp's
q8_0 cache keeps one fp16 scale per 32 values; a scale per 64-value row (this cache's first layout, 68 bytes)
let a head's few large dimensions set the step of all 64: greedy tokens of the fp32 default model were fp32's
argmax at 97.3-98.0% of ~710 positions by regime, and are at 99.0-99.2% with a scale per 16 values (groups of 32,
simulated: 98.6-98.7%; ops/bench/RESULTS.md, "The int8 KV cache per 16 values"). A value's error is at most s / 2.
Keeping the scales inside the row keeps one tensor per layer and cache, so slots, block copies, tensor-
parallel shards and every kernel signature stay as they are for the other cache dtypes.

The torch paths (`kernels.cpu`, `kernels.reference`) gather rows and widen them with `widen`; the native
CPU ops quantize in `rotary_store` (kernels/cpu/native/layer_ops.cpp) and read the codes in place in
`paged_decode` (paged_decode.cpp), each group's codes times its scale as they load, with the same arithmetic in
fp32 as `quantize` (so a row is stored identically by either, and a prefix hit reads what a cold prompt wrote).
On CUDA the Triton kernels do the same: `store_kv` quantizes as `quantize` does (kernels/triton/store.py),
decode and extend dequantize each tile in fp32, then to q's dtype.
"""

from __future__ import annotations

import torch

GROUP = 16  # values per scale
QMAX = 127


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def scale_bytes(head_dim: int) -> int:
    """Bytes of a row's scales (one fp16 per GROUP values) after its head_dim codes."""
    if head_dim % GROUP:
        raise ValueError(f"an int8 KV cache needs a head_dim divisible by {GROUP}, not {head_dim}")
    return 2 * (head_dim // GROUP)


def head_dim_of(row_width: int) -> int:
    """The head_dim whose int8 rows are row_width bytes wide (the inverse of `row_width` for int8)."""
    return row_width * GROUP // (GROUP + 2)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one token's row of one head in a cache of `dtype`."""
    return head_dim + scale_bytes(head_dim) if dtype == torch.int8 else head_dim


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 rows [..., D + D / 8]: the codes, then each group's fp16 scale."""
    head_dim = x.shape[-1]
    groups = x.float().reshape(*x.shape[:-1], head_dim // GROUP, GROUP)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / QMAX).half()
    wide = scale.float()
    inverse = torch.where(wide > 0, 1.0 / wide, torch.zeros_like(wide))  # 1 / 0 never reaches a code
    codes = torch.round(groups * inverse).clamp_(-QMAX, QMAX).to(torch.int8).reshape(x.shape)
    return torch.cat([codes, scale.reshape(*x.shape[:-1], -1).view(torch.int8)], dim=-1)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + D / 8] -> their groups' scales [..., D / GROUP] in fp32."""
    head_dim = head_dim_of(rows.shape[-1])
    return rows[..., head_dim:].contiguous().view(torch.float16).float()


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + D / 8] -> [..., D] in dtype (codes times their group's scale, in fp32, then rounded)."""
    head_dim = head_dim_of(rows.shape[-1])
    codes = rows[..., :head_dim].float().reshape(*rows.shape[:-1], head_dim // GROUP, GROUP)
    return (codes * scales(rows).unsqueeze(-1)).reshape(*rows.shape[:-1], head_dim).to(dtype)


def widen(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache as values of `dtype` (no copy when the cache already holds dtype)."""
    return dequantize(cached, dtype) if is_int8(cached) else cached.to(dtype)


def narrow(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x [..., D] as `cache` stores it (its rows for an int8 cache, else x in its dtype)."""
    return quantize(x) if is_int8(cache) else x.to(cache.dtype)


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as a read from `cache` would give it back, in x's dtype (x itself when the cache holds x's dtype)."""
    return x if cache.dtype == x.dtype else widen(narrow(x, cache), x.dtype)
