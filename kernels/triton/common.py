"""Small helpers shared by the Triton kernels' launchers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.kv_int8 import GROUP

KV_GROUP: tl.constexpr = tl.constexpr(GROUP)  # values per fp16 scale in an int8 cache's rows (kernels/kv_int8.py)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep full fp32 products (TF32 would cost ~1e-3 of accuracy); half types are exact anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _count_for(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the CPU interpreter runs programs in turn)."""
    if device.type != "cuda":
        return 1
    return _count_for(device.index if device.index is not None else torch.cuda.current_device())


def check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise ValueError("the Triton kernels need the head dimension contiguous (stride 1)")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def upcast_dots(dtype: torch.dtype) -> bool:
    """The CPU interpreter multiplies bf16 bit patterns in `tl.dot` (triton-lang/triton#11584, unsupported
    upstream), so under it the kernels widen half-precision dot operands to fp32. Products of two
    bf16 values are exact in fp32, so this matches the GPU's bf16 dot with fp32 accumulation."""
    return interpreting() and dtype != torch.float32


@triton.jit
def tile_dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation; UPCAST widens the operands first (see `upcast_dots`)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def load_kv_tile(cache_ptr, table_row, tokens, token_ok, dims, dim_ok, kv_head,
                 stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 QUANT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """[tokens, dims] ([BLOCK_T, BLOCK_D]) of one KV head, each token found through its sequence's block table. QUANT: an int8
    cache (kernels/kv_int8.py), whose rows are HEAD_DIM codes and then an fp16 scale per KV_GROUP of them:
    returns codes * their group's scale in fp32 (the caller rounds it to its compute dtype)."""
    blocks = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_ok, other=0).to(tl.int64)
    offsets = blocks[:, None] * stride_block + (tokens % BLOCK_SIZE)[:, None] * stride_slot
    rows = cache_ptr + offsets + kv_head * stride_head  # [tokens, 1]
    values = tl.load(rows + dims[None, :], mask=token_ok[:, None] & dim_ok[None, :], other=0.0)
    # One return, the branches assigning it: Triton compiles both returns of an early `return` and
    # refuses their different types (fp32 and int8), where the interpreter runs only the one taken.
    if QUANT:  # the scales follow the codes, 2-byte aligned (HEAD_DIM is a multiple of KV_GROUP)
        groups = tl.arange(0, BLOCK_D // KV_GROUP)
        scale_ptrs = (rows + HEAD_DIM).to(tl.pointer_type(tl.float16)) + groups[None, :]
        scales = tl.load(scale_ptrs, mask=token_ok[:, None] & (groups < HEAD_DIM // KV_GROUP)[None, :], other=0.0)
        tile = values.to(tl.float32) * spread_groups(scales.to(tl.float32), BLOCK_T, BLOCK_D)  # a load per group
    else:
        tile = values
    return tile


@triton.jit
def spread_groups(per_group, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """[ROWS, BLOCK_D // KV_GROUP] values of an int8 row's groups -> [ROWS, BLOCK_D]: each dim gets its group's."""
    spread = tl.broadcast_to(per_group[:, :, None], [ROWS, BLOCK_D // KV_GROUP, KV_GROUP])
    return tl.reshape(spread, [ROWS, BLOCK_D])


@triton.jit
def round_half_even(x):
    """x rounded to the nearest integer, ties to even (torch.round's rule), in x's float dtype. From x's floor
    f: x - f is exact (no `floor(x + 0.5)`, whose sum may round up, e.g. 0.49999997 + 0.5 -> 1.0)."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def online_softmax_update(scores, v, m_i, l_i, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Fold one tile of masked scores (-inf = hidden) and its values into the running max, sum
    and output. A row with no visible key so far keeps m = -inf and contributes nothing."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc
