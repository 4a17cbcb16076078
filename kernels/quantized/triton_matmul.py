"""Triton dequant-matmul for weight-only quantized linears: y = x @ W^T + bias from a `QuantizedWeight`.

Each program owns a [BLOCK_M, BLOCK_N] tile of the output and walks K in tiles, loading the codes
of a [BLOCK_K, BLOCK_N] slice of the weight and dequantizing them in registers (the float weight
never exists in memory), with an fp32 accumulator; the result is stored in x's dtype.

- **int4** (`_int4_kernel`): a tile reads BLOCK_K // 2 packed bytes per output row. The low
  nibbles are the even columns and the high nibbles the odd ones, so instead of interleaving
  them the kernel splits x the same way: acc += x[:, even] @ W_low + x[:, odd] @ W_high. Columns
  2j and 2j + 1 always share a group (group sizes are even), so one scale/min gather serves both.
- **int8** (`_int8_kernel`): per channel (one group per row) the tile's dot runs on the raw codes
  (exact in fp16/bf16) and the row's scale multiplies the accumulator once at the end; group-wise,
  each element is scaled in registers before the dot.

Any even group size dividing K works: scales are gathered per element by `column // group`, so
a K tile may span several groups (BLOCK_K is a multiple of the group when the group is a power of
two up to BLOCK_K). Tiles (`choose_blocks`; `blocks=` overrides): int4 up to 32 rows takes the narrow
tiles an H200 sweep picked; int8 and prefill keep the tiles chosen under the interpreter (decode:
BLOCK_M = 16, the smallest `tl.dot` tile, a narrow BLOCK_N and long K runs; prefill: 64-wide tiles).

Inputs live on x's device. Scales and mins may be fp32 (the layout's own), fp16 or bf16: the
kernel widens them to fp32. `prepare_for_triton` puts a weight on the device, contiguous, with
the scale dtype the caller chooses, once at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.quantized.layout import QuantizedWeight
from kernels.triton.common import dot_precision, interpreting, tile_dot, upcast_dots

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DECODE_MAX_M = 16


@dataclass(frozen=True)
class Blocks:
    """Tile sizes (powers of two, >= 16; int4 needs block_k >= 32) and launch hints for the GPU."""

    m: int
    n: int
    k: int
    warps: int = 4
    stages: int = 3


def choose_blocks(m: int, n: int, k: int, bits: int, group_size: int) -> Blocks:
    """int4 up to 32 rows (a decode step's): narrow tiles, 16 rows x 16 output columns (32 from 2,048
    columns, with 32 rows where there are more than 16) x 64 of K (128 past 1,024), 2 stages: swept on an
    H200 (`ops/bench/quant_tiles_gpu.py`, ops/bench/RESULTS.md), they took the default model's int4
    linears from 16-33 us to 7-19 us a call. Otherwise (int8, and prefill) as chosen under the
    interpreter, not yet swept: decode 16 rows, 32 columns, long K tiles (128 bytes of codes a row);
    prefill 64 x 64 tiles (32 x 64 up to M = 32). K tiles never exceed K's next power of two, and hold
    whole groups where the group is a power of two up to that size."""
    floor = 32 if bits == 4 else 16
    warps, stages = 4, 3
    if bits == 4 and m <= 32:
        block_m = 32 if m > DECODE_MAX_M and n >= 2048 else 16
        block_n, block_k, stages = (32 if n >= 2048 else 16), (64 if k <= 1024 else 128), 2
    elif m <= DECODE_MAX_M:
        block_m, block_n, block_k = 16, 32, 128
    else:
        block_m, block_n, block_k = (32 if m <= 32 else 64), 64, 64
    if group_size & (group_size - 1) == 0 and group_size <= 256:
        block_k = max(block_k, group_size)
    block_k = max(floor, min(block_k, triton.next_power_of_2(k)))
    return Blocks(block_m, block_n, block_k, warps, stages)


@triton.jit
def _int4_kernel(
    x_ptr, qweight_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr,
    M, N, K_HALF,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_mn, stride_mg, stride_om, stride_on,
    GROUP_HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K_HALF, BLOCK_KH):
        kb = start + tl.arange(0, BLOCK_KH)  # packed byte j holds columns 2j (low) and 2j + 1 (high)
        kb_ok = kb < K_HALF
        x_ok = row_ok[:, None] & kb_ok[None, :]
        x_even = tl.load(x_rows + (2 * kb)[None, :] * stride_xk, mask=x_ok, other=0.0)
        x_odd = tl.load(x_rows + (2 * kb + 1)[None, :] * stride_xk, mask=x_ok, other=0.0)
        w_ok = kb_ok[:, None] & col_ok[None, :]
        packed = tl.load(qweight_ptr + cols[None, :] * stride_wn + kb[:, None] * stride_wk, mask=w_ok, other=0)
        packed = packed.to(tl.int32)
        group = kb // GROUP_HALF
        scale = tl.load(scales_ptr + cols[None, :] * stride_sn + group[:, None] * stride_sg, mask=w_ok, other=0.0)
        low = tl.load(mins_ptr + cols[None, :] * stride_mn + group[:, None] * stride_mg, mask=w_ok, other=0.0)
        scale = scale.to(tl.float32)
        low = low.to(tl.float32)
        w_even = ((packed & 0xF).to(tl.float32) * scale + low).to(x_even.dtype)
        w_odd = ((packed >> 4).to(tl.float32) * scale + low).to(x_even.dtype)
        acc += tile_dot(x_even, w_even, PRECISION, UPCAST)
        acc += tile_dot(x_odd, w_odd, PRECISION, UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _int8_kernel(
    x_ptr, qweight_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg, stride_om, stride_on,
    GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        q = tl.load(qweight_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk, mask=w_ok, other=0)
        if PER_CHANNEL:  # |q| <= 127 is exact in fp16/bf16: the row's scale is applied once, below
            # (through fp32: the interpreter casts int8 to bf16 as a bit pattern, not a value)
            acc += tile_dot(x, q.to(tl.float32).to(x.dtype), PRECISION, UPCAST)
        else:
            scale = tl.load(scales_ptr + cols[None, :] * stride_sn + (k // GROUP)[:, None] * stride_sg,
                            mask=w_ok, other=0.0)
            w = (q.to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
            acc += tile_dot(x, w, PRECISION, UPCAST)
    if PER_CHANNEL:
        acc *= tl.load(scales_ptr + cols * stride_sn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    n, k = weight.shape
    if x.dim() != 2:
        raise ValueError(f"quantized_matmul takes x as [M, K]; got shape {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32; got {x.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features; the weight [{n}, {k}] takes {k}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton kernels run on CUDA (or on a CPU under TRITON_INTERPRET=1); x is on {x.device}")
    code_dtype = torch.uint8 if weight.bits == 4 else torch.int8
    if weight.qweight.dtype != code_dtype:
        raise ValueError(f"int{weight.bits} codes must be {code_dtype}; got {weight.qweight.dtype}")
    parts = {"qweight": weight.qweight, "scales": weight.scales}
    if weight.mins is not None:
        parts["mins"] = weight.mins
    if bias is not None:
        if bias.shape != (n,) or not bias.is_floating_point():
            raise ValueError(f"bias must be a float tensor of shape ({n},); got {bias.dtype} {tuple(bias.shape)}")
        parts["bias"] = bias
    for name, tensor in parts.items():
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} and x on {x.device}: prepare_for_triton puts a "
                             "weight on x's device once, at load")
        if name in ("scales", "mins") and tensor.dtype not in SCALE_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32; got {tensor.dtype}")


def _check_blocks(blocks: Blocks, bits: int) -> None:
    sizes = (blocks.m, blocks.n, blocks.k)
    if any(size < 16 or size & (size - 1) for size in sizes) or (bits == 4 and blocks.k < 32):
        raise ValueError(f"block sizes must be powers of two >= 16 (int4: block k >= 32); got {sizes}")


def quantized_matmul(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                     blocks: Blocks | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(weight)^T [K, N] (+ bias [N]) -> [M, N] in x's dtype, accumulated in fp32.

    x may have any strides; half-precision x multiplies weights dequantized to its own dtype (as
    a bf16 linear would), fp32 x full-fp32 weights. `blocks` overrides `choose_blocks`."""
    _check(x, weight, bias)
    n, k = weight.shape
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    tiles = blocks or choose_blocks(m, n, k, weight.bits, weight.group_size)
    _check_blocks(tiles, weight.bits)
    grid = (triton.cdiv(m, tiles.m), triton.cdiv(n, tiles.n))
    bias_arg = bias.contiguous() if bias is not None else out  # `out` is never read: HAS_BIAS is off
    q, s = weight.qweight, weight.scales
    launch = {"num_warps": tiles.warps, "num_stages": tiles.stages, "PRECISION": dot_precision(x.dtype),
              "UPCAST": upcast_dots(x.dtype), "HAS_BIAS": bias is not None, "BLOCK_M": tiles.m, "BLOCK_N": tiles.n}
    if weight.bits == 4:
        assert weight.mins is not None  # the layout's invariant for int4
        mins = weight.mins
        _int4_kernel[grid](
            x, q, s, mins, bias_arg, out, m, n, k // 2,
            x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
            mins.stride(0), mins.stride(1), out.stride(0), out.stride(1),
            GROUP_HALF=weight.group_size // 2, BLOCK_KH=tiles.k // 2, **launch,
        )
    else:
        per_channel = weight.group_size == k
        _int8_kernel[grid](
            x, q, s, bias_arg, out, m, n, k,
            x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
            out.stride(0), out.stride(1),
            GROUP=1 if per_channel else weight.group_size,  # per channel the group is not read: no K specialization
            PER_CHANNEL=per_channel, BLOCK_K=tiles.k, **launch,
        )
    return out


def prepare_for_triton(weight: QuantizedWeight, device: torch.device | str,
                       scale_dtype: torch.dtype = torch.float32) -> QuantizedWeight:
    """The weight as the kernels read it best, made once at load: every tensor on `device` and
    contiguous (rows of codes streamed in order), scales and mins in `scale_dtype`.

    float32 keeps the layout's scales exactly. float16 halves their bytes (int4 at group 32 reads
    8 bytes of fp32 scale and min per 16 bytes of codes, 4 in fp16) and is GGUF's own precision for
    Q4_0/Q4_1/Q8_0 blocks, so weights read from a GGUF lose nothing; scales quantized afresh move
    by at most 2^-11 relative (scales below fp16's normal range, ~6e-5, lose more)."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be float16, bfloat16 or float32; got {scale_dtype}")

    def place(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return tensor.to(device=device, dtype=dtype or tensor.dtype).contiguous()

    return QuantizedWeight(
        bits=weight.bits, qweight=place(weight.qweight), scales=place(weight.scales, scale_dtype),
        mins=None if weight.mins is None else place(weight.mins, scale_dtype), group_size=weight.group_size,
    )
