"""CPU execution of weight-only quantized matmuls: tollway's native ops, or torch's own.

Two kernels, chosen per layer at packing (`pack_for_cpu(kernel=...)`, "auto" by default):

- **native** (`torch.ops.tollway_cpu.int4_matmul` / `int8_matmul`, kernels/cpu/native/quantized_matmul.cpp):
  dequantize-on-the-fly in fp32 with the layout's fp32 scales and mins as they are, for fp32 and bf16
  activations. The codes are repacked once into tiles of 8 output rows with their blocks interleaved
  (one contiguous stream per tile, `native_tiles`); int4 blocks in GGUF's nibble order (code j and
  j + 16 share byte j: one shift unpacks them), groups multiples of 32.
- **torch** (`aten._weight_int8pack_mm(x, w int8 [N, K], scales [N])`;
  `aten._convert_weight_to_int4pack_for_cpu(codes int32 [N, K], inner_k_tiles)` once, then
  `aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros [K / group, N, 2])` with
  w = (q - 8) * scale + zero, i.e. zero = min + 8 * scale): scales in x's dtype (torch checks it), so
  in bf16 they are rounded to bf16 once; group sizes 32, 64, 128, 256. On x86 only their bf16 path is
  vectorized (fp32 runs a scalar loop: ops/bench/RESULTS.md, "Issue 22").

"auto" takes native where the native library loads (kernels.cpu.native.load()) and torch elsewhere.

In decode steps (`decode_step()`) the native row kernel is the `*_matmul_q8` one (kernels/cpu/native/
quantized_q8.cpp): x quantized to int8 per block of 32 columns (llama.cpp's Q8_0), the products as integer
multiply-adds, AVX512-VNNI's where the CPU has them (quantized_vnni.cpp; on a 2-core AVX512-BF16 host 1.3-2x the
float row kernel's speed at 1-8 rows, level with oneDNN's bf16 GEMM on prepacked weights at 32 rows), else AVX2's
(quantized_avx2.cpp; on a 2-core AVX2 host 1.4x the float row kernel at one row, 3.2-3.4x at 4-32, int4;
ops/bench/RESULTS.md, "Issue 22"). x's rounding adds an error of the order of bf16's own (7 bits and a sign per
value, one scale per 32), which the decode-sized perplexity tests bound (tests/integration/test_eval_ppl.py);
a packing made with activations="float" keeps the float kernels in every step, whose results are the
dequantized model's to summation order.
Ownership: a `CpuPacked` is built once per layer at load and owns its tensors; the layout's
`QuantizedWeight` it came from can be dropped afterwards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu import native
from kernels.quantized.layout import QuantizedWeight, unpack_int4

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""The group sizes `_weight_int4pack_mm_for_cpu` accepts (the native kernel: any multiple of 32)."""
NATIVE_BLOCK = 32
NATIVE_TILE = 8
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNELS = ("auto", "native", "torch")
ACTIVATIONS = ("int8", "float")
"""What quantized matmuls in decode steps take x as (`pack_for_cpu`, TOLLWAY_QUANTIZED_ACTIVATIONS)."""
DEQUANTIZE_FROM_ROWS: dict[tuple[torch.dtype, int], int] = {
    (torch.bfloat16, 4): 16, (torch.bfloat16, 8): 64, (torch.float32, 4): 1024, (torch.float32, 8): 1024,
}
"""The shipped defaults; an engine measures this CPU's own at start (kernels/quantized/crossover.py, `_MEASURED`).
(activation dtype, bits) -> from this many rows of x the native float row kernel dequantizes the weight
once (into x's dtype) and runs one GEMM on it (`F.linear`) instead. fp32: the row kernel won at every size
measured, up to 512 rows (1.3-2.7x; 2 threads on a 2-core AVX512-BF16 host, ops/bench/quantization.py's
crossover, ops/bench/RESULTS.md "Issue 22"), so only steps of the whole default token budget dequantize.
bf16 (prefill, and decode steps on CPUs without AVX512-VNNI): int8 rows 35.7 vs 39.6 ms dequantizing at 48 rows,
45.9 vs 44.9 at 64; int4 rows 18.4 vs 19.5 at 16, 34.7 vs 24.4 at 32 (30 layers' projections, same host)."""
Q8_DEQUANTIZE_FROM_ROWS: dict[int, int] = {4: 64, 8: 128}
"""The same crossover for the int8-activation row kernels (bits -> rows), which run in decode steps only
(`decode_step`); measured for bf16 on AVX512-VNNI: two integer multiply-adds per 128 weights hold out far longer (2 threads,
30 layers' projections: int4 24.7 vs 29.5 ms dequantizing at 64 rows, int8 33.5 vs 44.7 at 128;
ops/bench/RESULTS.md "Issue 22"). Prefill and prompt logprobs keep x as it is: with x rounded there, bf16
int4's teacher-forced argmax agreement with the fp32 model fell from 96.9% to 90.6%
(tests/integration/test_quantized_smollm2.py)."""


@dataclass(frozen=True)
class CpuPacked:
    """A quantized weight in the form one CPU kernel takes."""

    kernel: str
    bits: int
    weight: torch.Tensor
    """native: tiles (`native_tiles`); torch: int8 [N, K] or its int4pack."""
    scales: torch.Tensor
    """native: fp32 tiles [T, K // group, 8] (int8: [T, 8]); torch: [N] (int8) or scales_and_zeros
    [K // group, N, 2] (int4), in `dtype`."""
    mins: torch.Tensor | None
    """native int4 only: fp32 tiles as the scales."""
    group_size: int
    dtype: torch.dtype
    shape: tuple[int, int]
    """(N, K) of the float weight."""
    int8_activations: bool = False
    """native only: in decode steps the row kernel quantizes x to int8 (the *_matmul_q8 ops)."""
    q8_scales: torch.Tensor | None = None
    q8_mins: torch.Tensor | None = None
    """native int4 whose decode steps run the AVX2 q8 kernel: the scales and mins as fp16 tiles, which that
    kernel reads instead (at one row of x it is bound by reading: 2 bytes per 32 weights instead of 8; exact
    for a GGUF's Q4_0/Q4_1 blocks, whose scales are fp16; a relative 2^-11 otherwise, well under x's rounding)."""

    def nbytes(self) -> int:
        parts = [self.weight, self.scales, self.mins, self.q8_scales, self.q8_mins]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows padded with zeros to a whole number of tiles."""
    extra = -t.shape[0] % NATIVE_TILE
    return torch.cat((t, t.new_zeros((extra, *t.shape[1:])))) if extra else t


def native_tiles(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, K] (int4: uint8 in [0, 15]; int8: int8) -> the native kernel's tiles [ceil(N / 8), 16 * K / b]:
    tile t holds rows 8t .. 8t + 7 (zero rows past N), 16-byte blocks interleaved row by row (block b of
    row c at ((b * 8) + c) * 16); an int4 block is 32 codes, byte j = code j | code (j + 16) << 4."""
    k = codes.shape[1]
    rows = _pad_rows(codes)
    if bits == 4:
        halves = rows.to(torch.uint8).view(-1, NATIVE_TILE, k // NATIVE_BLOCK, 2, NATIVE_BLOCK // 2)
        blocks = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)  # [T, 8, K / 32, 16]
    else:
        blocks = rows.view(-1, NATIVE_TILE, k // 16, 16)
    return blocks.transpose(1, 2).contiguous().view(blocks.shape[0], -1)


def native_scale_tiles(values: torch.Tensor) -> torch.Tensor:
    """Per-row values [N, G] (or [N]) -> fp32 tiles [T, G, 8] (or [T, 8]), zero past N."""
    rows = _pad_rows(values.float().reshape(values.shape[0], -1))
    return rows.view(-1, NATIVE_TILE, rows.shape[1]).transpose(1, 2).contiguous()


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


def pack_for_cpu(weight: QuantizedWeight, dtype: torch.dtype, kernel: str = "auto",
                 activations: str = "int8") -> CpuPacked:
    """Prepare `weight` for `cpu_matmul` on activations of `dtype`; ValueError for what the kernel
    cannot run (int8 with more than one group per row, an unsupported int4 group size or dtype).
    `activations` (ACTIVATIONS): "int8" lets decode steps round x to int8 where a native q8 kernel runs
    (`int8_activations`), "float" keeps x as it is in every step."""
    if dtype not in CPU_DTYPES:
        raise ValueError(f"quantized matmuls run on float32, bfloat16 or float16 activations, not {dtype}")
    n, k = weight.shape
    if weight.bits == 8 and weight.group_size != k:
        raise ValueError(f"the CPU int8 matmul takes one scale per output channel (group size {k}), "
                         f"not groups of {weight.group_size}; requantize per channel first")
    if weight.bits == 4 and weight.group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"the CPU int4 matmul takes groups of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                         f"not {weight.group_size}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown activations {activations!r}; choose one of {', '.join(ACTIVATIONS)}")
    kernel = choose_kernel(kernel, weight, dtype)
    if kernel == "native":
        q8 = activations == "int8" and int8_activations(dtype, k)
        if weight.bits == 8:
            return CpuPacked("native", 8, native_tiles(weight.qweight, 8), native_scale_tiles(weight.scales).view(-1, 8),
                             None, k, dtype, (n, k), q8)
        assert weight.mins is not None  # int4 weights carry mins (QuantizedWeight checks it)
        scales, mins = native_scale_tiles(weight.scales), native_scale_tiles(weight.mins)
        half = q8 and native.q8_kernel() == "avx2"
        return CpuPacked("native", 4, native_tiles(unpack_int4(weight.qweight), 4), scales, mins, weight.group_size,
                         dtype, (n, k), q8, scales.half() if half else None, mins.half() if half else None)
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


_DECODE_STEP: ContextVar[bool] = ContextVar("tollway_quantized_decode_step", default=False)


@contextmanager
def decode_step() -> Iterator[None]:
    """Within: a decode step (each row a sequence's next token, or its draft's), where packings with
    `int8_activations` take x as int8 (`Q8_DEQUANTIZE_FROM_ROWS`). Outside (prefill, prompt logprobs)
    every quantized matmul takes x as it is. The engine's runner enters it for steps with no prefill."""
    token = _DECODE_STEP.set(True)
    try:
        yield
    finally:
        _DECODE_STEP.reset(token)


@torch.compiler.assume_constant_result
def in_decode_step() -> bool:
    """Whether the caller is within `decode_step()`. Under `torch.compile` the answer is read once, while
    tracing, and kept in the graph (dynamo cannot read a ContextVar): a compiled graph of quantized matmuls
    must therefore always be called as it was traced (workers/engine/compiled_decode.py: decode steps only,
    always within `decode_step()`)."""
    return _DECODE_STEP.get()


def rounds_activations(packed: CpuPacked) -> bool:
    """Whether a call on `packed` now runs an int8-activation kernel (its packing allows, a decode step)."""
    return packed.int8_activations and in_decode_step()


def int8_activations(dtype: torch.dtype, in_features: int) -> bool:
    """Whether native row kernels for activations of `dtype` can take x as int8 (the *_matmul_q8 ops: every
    CPU the native library builds on has one, AVX512-VNNI's or AVX2's)."""
    return dtype in (torch.bfloat16, torch.float32) and in_features % 32 == 0 and native.q8_kernel() is not None


def dequantize_native(packed: CpuPacked) -> torch.Tensor:
    """The float weight [N, K] in packed.dtype of a native packing (w = q * scale + min, rounded as
    kernels/quantized/layout.dequantize rounds it, then to the dtype)."""
    if packed.bits == 8:
        return torch.ops.tollway_cpu.int8_dequantize(packed.weight, packed.scales, packed.shape[0], packed.dtype)
    return torch.ops.tollway_cpu.int4_dequantize(packed.weight, packed.scales, packed.mins, packed.shape[0],
                                                 packed.group_size, packed.dtype)


def row_kernel(packed: CpuPacked, rounded: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The native row kernel of `packed` with its weight bound (None for torch's kernels): what `cpu_matmul`
    runs below `dequantize_from_rows(packed, rounded)` rows, without its per-call dispatch (~2 us a call, 120
    calls a decode step of the default model); `rounded`: the int8-activation kernel (packed.int8_activations)."""
    if packed.kernel != "native":
        return None
    ops, n = torch.ops.tollway_cpu, packed.shape[0]
    if packed.bits == 8:
        op = ops.int8_matmul_q8 if rounded else ops.int8_matmul
        run = functools.partial(op.default, qweight=packed.weight, scales=packed.scales, n=n)
    elif rounded and packed.q8_scales is not None:
        run = functools.partial(ops.int4_matmul_q8.default, qweight=packed.weight, scales=packed.q8_scales,
                                mins=packed.q8_mins, n=n, group=packed.group_size)
    else:
        op = ops.int4_matmul_q8 if rounded else ops.int4_matmul
        run = functools.partial(op.default, qweight=packed.weight, scales=packed.scales, mins=packed.mins, n=n,
                                group=packed.group_size)
    return run


_MEASURED: dict[tuple[torch.dtype, int, bool], int] = {}
"""(dtype, bits, rounded) -> the crossover measured on this CPU in this process (kernels/quantized/crossover.py);
it overrides the shipped constants above. Written once per key, at engine start."""


def record_crossover(dtype: torch.dtype, bits: int, rounded: bool, rows: int) -> None:
    _MEASURED[(dtype, bits, rounded)] = rows


def crossover_state() -> frozenset[tuple[tuple[torch.dtype, int, bool], int]]:
    """The crossovers measured so far in this process (what `dequantize_from_rows` reads), as a hashable value."""
    return frozenset(_MEASURED.items())


def measured_crossover(dtype: torch.dtype, bits: int, rounded: bool) -> int | None:
    return _MEASURED.get((dtype, bits, rounded))


def dequantize_from_rows(packed: CpuPacked, rounded: bool) -> int:
    """From this many rows of x a native packing dequantizes and runs one GEMM instead of its row kernel
    (`rounded`: the int8-activation one): the crossover measured on this CPU, else the shipped one."""
    measured = _MEASURED.get((packed.dtype, packed.bits, rounded))
    if measured is not None:
        return measured
    if rounded:
        return Q8_DEQUANTIZE_FROM_ROWS[packed.bits]
    return DEQUANTIZE_FROM_ROWS[(packed.dtype, packed.bits)]


TILE_GEMM_MAX_ROWS = 1024
"""Up to this many rows of bf16 x (from the crossover on) a native packing runs the tile kernel
(`*_tile_matmul`, kernels/cpu/native/quantized_tiles.cpp: each 32 weight rows dequantized once, every row of x
multiplied by them on AVX512-BF16) instead of dequantizing the whole weight for one unpacked GEMM. 30 layers'
projections, 2 threads on a 2-core AVX512-BF16 EPYC, int4: 16 rows 18.9 ms against 24.5, 48 rows 34.1 against
48.2, 128 rows 76.5 against 92.1, 1024 rows 510 against 563 (oneDNN's packed bf16 GEMM of the unquantized model:
11.3, 33.4, 73.8, 542 ms); int8 alike (ops/bench/RESULTS.md, issue 22, 2026-11-26). Not measured beyond 1024."""


def tile_matmul_fits(packed: CpuPacked, x: torch.Tensor) -> bool:
    return (packed.kernel == "native" and packed.dtype == torch.bfloat16 and x.dtype == torch.bfloat16
            and x.shape[0] <= TILE_GEMM_MAX_ROWS and packed.shape[1] % 32 == 0 and native.tile_matmul_available())


def dense_matmul(x: torch.Tensor, packed: CpuPacked) -> torch.Tensor:
    """x [M, K] (contiguous) @ W.T for a native packing from its row kernel's crossover on: the tile kernel
    where it fits (`tile_matmul_fits`), else the weight dequantized into x's dtype and one GEMM."""
    if tile_matmul_fits(packed, x):
        if packed.bits == 8:
            return torch.ops.tollway_cpu.int8_tile_matmul(x, packed.weight, packed.scales, packed.shape[0])
        return torch.ops.tollway_cpu.int4_tile_matmul(x, packed.weight, packed.scales, packed.mins, packed.shape[0],
                                                      packed.group_size)
    return F.linear(x, dequantize_native(packed))


def cpu_matmul(x: torch.Tensor, packed: CpuPacked) -> torch.Tensor:
    """x [M, K] in packed.dtype -> x @ W.T [M, N] in the same dtype."""
    x = x.contiguous()
    if packed.kernel == "native":
        rounded = rounds_activations(packed)
        if x.shape[0] >= dequantize_from_rows(packed, rounded):
            return dense_matmul(x, packed)
        run = row_kernel(packed, rounded)
        assert run is not None
        return run(x)
    if packed.bits == 8:
        return torch.ops.aten._weight_int8pack_mm(x, packed.weight, packed.scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed.weight, packed.group_size, packed.scales)
