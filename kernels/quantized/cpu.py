"""CPU execution of weight-only quantized matmuls: tollway's native ops, or torch's own.

Two kernels, chosen per layer at packing (`pack_for_cpu(kernel=...)`, "auto" by default):

- **native** (`torch.ops.tollway_cpu.int4_matmul` / `int8_matmul`, kernels/cpu/native/quantized_matmul.cpp):
  dequantize-on-the-fly in fp32 with the layout's fp32 scales and mins as they are, for fp32 and bf16
  activations. int4 codes are repacked once into GGUF's nibble order within 32-blocks (code j and
  j + 16 share byte j), which unpacks with one shift; groups must be multiples of 32.
- **torch** (`aten._weight_int8pack_mm(x, w int8 [N, K], scales [N])`;
  `aten._convert_weight_to_int4pack_for_cpu(codes int32 [N, K], inner_k_tiles)` once, then
  `aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros [K / group, N, 2])` with
  w = (q - 8) * scale + zero, i.e. zero = min + 8 * scale): scales in x's dtype (torch checks it), so
  in bf16 they are rounded to bf16 once; group sizes 32, 64, 128, 256. On x86 only their bf16 path is
  vectorized (fp32 runs a scalar loop: ops/bench/RESULTS.md, "Issue 22").

"auto" takes native where the native library loads (kernels.cpu.native.load()) and torch elsewhere.
Ownership: a `CpuPacked` is built once per layer at load and owns its tensors; the layout's
`QuantizedWeight` it came from can be dropped afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu import native
from kernels.quantized.layout import QuantizedWeight, unpack_int4

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""The group sizes `_weight_int4pack_mm_for_cpu` accepts (the native kernel: any multiple of 32)."""
NATIVE_BLOCK = 32
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNELS = ("auto", "native", "torch")
DEQUANTIZE_FROM_ROWS = 16
"""From this many rows of x the native kernel dequantizes the weight once (into x's dtype) and runs one
GEMM on it (`F.linear`): prefill chunks are compute-bound, where a row-by-row kernel loses (measured:
ops/bench/RESULTS.md, "Issue 22")."""


@dataclass(frozen=True)
class CpuPacked:
    """A quantized weight in the form one CPU kernel takes."""

    kernel: str
    bits: int
    weight: torch.Tensor
    """int8 [N, K]; int4: uint8 [N, K // 2] in native block order or torch's int4pack."""
    scales: torch.Tensor
    """native: fp32 [N, K // group] (int8: [N]); torch: [N] (int8) or scales_and_zeros
    [K // group, N, 2] (int4), in `dtype`."""
    mins: torch.Tensor | None
    """native int4 only: fp32 [N, K // group]."""
    group_size: int
    dtype: torch.dtype
    shape: tuple[int, int]
    """(N, K) of the float weight."""

    def nbytes(self) -> int:
        parts = [self.weight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)


def native_block_order(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] -> uint8 [N, K // 2]: per block of 32, byte j = code j | code (j + 16) << 4."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).view(n, k // NATIVE_BLOCK, 2, NATIVE_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def choose_kernel(kernel: str, weight: QuantizedWeight, dtype: torch.dtype) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"unknown CPU kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    native_fits = dtype in (torch.float32, torch.bfloat16) and (
        weight.group_size % NATIVE_BLOCK == 0 if weight.bits == 4 else weight.shape[1] % 16 == 0)
    if kernel == "native" and not native_fits:
        raise ValueError(f"the native kernel takes fp32/bf16 activations, int4 groups of a multiple of "
                         f"{NATIVE_BLOCK} and int8 rows of a multiple of 16")
    if kernel == "native" and not native.load():
        raise ValueError(str(native.unavailable_reason()))
    if kernel == "auto":
        return "native" if native_fits and native.load() else "torch"
    return kernel


def pack_for_cpu(weight: QuantizedWeight, dtype: torch.dtype, kernel: str = "auto") -> CpuPacked:
    """Prepare `weight` for `cpu_matmul` on activations of `dtype`; ValueError for what the kernel
    cannot run (int8 with more than one group per row, an unsupported int4 group size or dtype)."""
    if dtype not in CPU_DTYPES:
        raise ValueError(f"quantized matmuls run on float32, bfloat16 or float16 activations, not {dtype}")
    n, k = weight.shape
    if weight.bits == 8 and weight.group_size != k:
        raise ValueError(f"the CPU int8 matmul takes one scale per output channel (group size {k}), "
                         f"not groups of {weight.group_size}; requantize per channel first")
    if weight.bits == 4 and weight.group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"the CPU int4 matmul takes groups of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                         f"not {weight.group_size}")
    kernel = choose_kernel(kernel, weight, dtype)
    if kernel == "native":
        if weight.bits == 8:
            scales = weight.scales.reshape(n).float().contiguous()
            return CpuPacked("native", 8, weight.qweight.contiguous(), scales, None, k, dtype, (n, k))
        assert weight.mins is not None  # int4 weights carry mins (QuantizedWeight checks it)
        return CpuPacked("native", 4, native_block_order(unpack_int4(weight.qweight)),
                         weight.scales.float().contiguous(), weight.mins.float().contiguous(), weight.group_size,
                         dtype, (n, k))
    if weight.bits == 8:
        scales = weight.scales.reshape(n).to(dtype).contiguous()
        return CpuPacked("torch", 8, weight.qweight.contiguous(), scales, None, k, dtype, (n, k))
    if n % 16:
        raise ValueError(f"torch's CPU int4 packing takes out_features in multiples of 16, not {n}")
    assert weight.mins is not None
    codes = unpack_int4(weight.qweight).to(torch.int32).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)  # inner_k_tiles: unused on CPU
    scales = weight.scales.float()
    zeros = weight.mins.float() + 8 * scales
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).to(dtype).contiguous()
    return CpuPacked("torch", 4, packed, scales_and_zeros, None, weight.group_size, dtype, (n, k))


def dequantize_native(packed: CpuPacked) -> torch.Tensor:
    """The float weight [N, K] in packed.dtype of a native packing (w = q * scale + min, rounded as
    kernels/quantized/layout.dequantize rounds it, then to the dtype)."""
    if packed.bits == 8:
        return torch.ops.tollway_cpu.int8_dequantize(packed.weight, packed.scales, packed.dtype)
    return torch.ops.tollway_cpu.int4_dequantize(packed.weight, packed.scales, packed.mins, packed.group_size,
                                                 packed.dtype)


def cpu_matmul(x: torch.Tensor, packed: CpuPacked) -> torch.Tensor:
    """x [M, K] in packed.dtype -> x @ W.T [M, N] in the same dtype."""
    x = x.contiguous()
    if packed.kernel == "native":
        if x.shape[0] >= DEQUANTIZE_FROM_ROWS:
            return F.linear(x, dequantize_native(packed))
        if packed.bits == 8:
            return torch.ops.tollway_cpu.int8_matmul(x, packed.weight, packed.scales)
        return torch.ops.tollway_cpu.int4_matmul(x, packed.weight, packed.scales, packed.mins, packed.group_size)
    if packed.bits == 8:
        return torch.ops.aten._weight_int8pack_mm(x, packed.weight, packed.scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed.weight, packed.group_size, packed.scales)
