"""The int8 KV cache (`TOLLWAY_KV_CACHE_DTYPE=int8`, CPU and GPU): each token's K (or V) row of one head is kept as
head_dim int8 codes followed by its own fp32 scale, in one int8 tensor [num_blocks, block_size, Hkv, D + 4].

A row x of D values is stored as q = round(x / s) with s = max|x| / 127 (q in [-127, 127]; a row of
zeros has s = 0) and read back as q * s. Per-(token, head) scales are what llama.cpp's q8_0 cache does
per 32 values: the error of a value is at most s / 2, about 0.4% of its row's largest magnitude.
Keeping the scale inside the row keeps one tensor per layer and cache, so slots, block copies, tensor-
parallel shards and every kernel signature stay as they are for the other cache dtypes.

The torch paths (`kernels.cpu`, `kernels.reference`) gather rows and widen them with `widen`; the native
CPU ops quantize in `rotary_store` (kernels/cpu/native/layer_ops.cpp) and read the codes in place in
`paged_decode` (paged_decode.cpp), with the same arithmetic in fp32 as `quantize` (so a row is stored identically by either,
and a prefix hit reads what a cold prompt wrote). On CUDA the Triton kernels do the same: `store_kv` quantizes
as `quantize` does (kernels/triton/store.py), decode and extend dequantize each tile in fp32, then to q's dtype.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # the fp32 scale at the end of each row
QMAX = 127


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one token's row of one head in a cache of `dtype`."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 rows [..., D + 4]: the codes, then the scale's four bytes."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax / QMAX
    inverse = torch.where(amax > 0, 1.0 / scale, torch.zeros_like(scale))  # 1 / 0 never reaches a code
    codes = torch.round(xf * inverse).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([codes, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + 4] -> [..., D] in dtype (codes times their row's scale, in fp32, then rounded)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)


def widen(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache as values of `dtype` (no copy when the cache already holds dtype)."""
    return dequantize(cached, dtype) if is_int8(cached) else cached.to(dtype)


def narrow(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x [..., D] as `cache` stores it (its rows for an int8 cache, else x in its dtype)."""
    return quantize(x) if is_int8(cache) else x.to(cache.dtype)


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x as a read from `cache` would give it back, in x's dtype (x itself when the cache holds x's dtype)."""
    return x if cache.dtype == x.dtype else widen(narrow(x, cache), x.dtype)
