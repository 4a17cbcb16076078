"""The CPU quantized matmuls (tollway's native ops and torch's weight-only ops) on the layout: the
same product as dequantize() + F.linear within the rounding of the op's dtype; clear errors."""

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import native
from kernels.quantized.cpu import (
    cpu_matmul,
    decode_step,
    dequantize_from_rows,
    dequantize_native,
    native_tiles,
    pack_for_cpu,
    rounds_activations,
)
from kernels.quantized.layout import QuantizedWeight, dequantize, quantize_int4, quantize_int8
from tests.required import bf16_kernels_expected, require_bf16_kernels, unavailable

# Relative to sum_k |x_k w_nk|, a bound on any summation order's rounding: fp32 accumulation, plus
# in bf16 the output's rounding (2^-9) and, for torch's kernel, the scales' (and zeros') rounding to bf16.
BOUND = {torch.float32: 2e-6, torch.bfloat16: 2**-7}


@pytest.fixture(params=["native", "torch"])
def kernel(request: pytest.FixtureRequest) -> str:
    if request.param == "native" and not native.load():
        unavailable(str(native.unavailable_reason()))
    return request.param


def _weight(bits: int, n: int, k: int, group_size: int, seed: int) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize_int8(w) if bits == 8 else quantize_int4(w, group_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (4, 32), (4, 64), (4, 128)])
@pytest.mark.parametrize("m", [1, 5, 15, 32, 70, 130])  # native: row kernel (passes of up to 8 rows + rest) up to
# dequantize_from_rows (16 to 1024 by dtype, bits and kernel), dequantize + GEMM from there
@pytest.mark.parametrize("in_decode_step", [False, True])  # native: x rounded to int8 in decode steps
def test_cpu_matmul_matches_dequantize_then_linear(kernel: str, dtype: torch.dtype, bits: int,
                                                    group_size: int | None, m: int, in_decode_step: bool) -> None:
    n, k = (99 if kernel == "native" else 96), 256  # native: tiles of 8 and 4 weight rows, single-row tails
    weight = _weight(bits, n, k, group_size or k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m)).to(dtype)
    packed = pack_for_cpu(weight, dtype, kernel)
    assert packed.kernel == kernel
    with decode_step() if in_decode_step else nullcontext():
        out = cpu_matmul(x, packed)
        rounded = rounds_activations(packed)
    assert rounded == (in_decode_step and packed.int8_activations)
    assert out.dtype == dtype and out.shape == (m, n)
    w = dequantize(weight)
    expected = F.linear(x.float(), w)
    bound = BOUND[dtype] * (x.float().abs() @ w.abs().T) + 1e-6
    if rounded and m < dequantize_from_rows(packed, rounded):  # q8: plus x's rounding, half a step
        bound += (_q8_steps(x) / 2) @ w.abs().T
    assert ((out.float() - expected).abs() <= bound).all(), (out.float() - expected).abs().max()


def _q8_steps(x: torch.Tensor) -> torch.Tensor:
    """Each column's int8 step when x is quantized per row and block of 32: max |x_block| / 127."""
    blocks = x.float().view(x.shape[0], -1, 32)
    return (blocks.abs().amax(dim=-1, keepdim=True) / 127).expand_as(blocks).reshape(x.shape)


def _q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the q8 kernels see it: rounded to its block's int8 step (round half to even), as floats."""
    steps = _q8_steps(x)
    return torch.where(steps > 0, torch.round(x.float() / torch.where(steps > 0, steps, 1)), 0) * steps


@pytest.mark.parametrize(("q8_kernel", "bits", "group_size", "half_scales"), [
    (kernel, bits, group, half) for kernel in ("avx2", "vnni") for bits, group in ((8, None), (4, 32), (4, 64))
    for half in (False, True) if not half or (bits == 4 and kernel == "avx2")])  # fp16 tiles: int4 on AVX2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_kernels_are_the_dequantized_product_of_x_rounded_per_block(q8_kernel: str, half_scales: bool,
                                                                      dtype: torch.dtype, bits: int,
                                                                      group_size: int | None) -> None:
    """The *_matmul_q8 ops compute (x rounded to int8 per block of 32) @ W.T exactly but for fp32
    summation order; int4's min term takes x itself. Both kernels: AVX2's wherever the library builds
    (int4 also on fp16 scale and min tiles: then W is theirs), AVX512-VNNI's where the CPU has it (elsewhere
    it refuses). Packings allow them in both dtypes unless made with activations="float"."""
    if not native.load():
        unavailable(str(native.unavailable_reason()))
    n, k = 99, 320  # tiles of 8 rows with a tail of 3; 10 blocks of 32
    weight = _weight(bits, n, k, group_size or k, seed=7)
    if bits == 8:  # the most negative code (a GGUF Q8_0 block may hold it): |w| = 128 as the unsigned operand
        weight.qweight[:5, :40] = -128
    packed = pack_for_cpu(weight, dtype, "native")
    assert packed.int8_activations
    assert not pack_for_cpu(weight, dtype, "native", activations="float").int8_activations

    assert (packed.q8_scales is not None) == (bits == 4 and native.q8_kernel() == "avx2")
    tile_scales, tile_mins = packed.scales, packed.mins
    if half_scales:
        assert tile_mins is not None and weight.mins is not None
        tile_scales, tile_mins = tile_scales.half(), tile_mins.half()
        weight = replace(weight, scales=weight.scales.half().float(), mins=weight.mins.half().float())

    def run(x: torch.Tensor) -> torch.Tensor:
        if bits == 8:
            return torch.ops.tollway_cpu.int8_matmul_q8(x, packed.weight, packed.scales, n, q8_kernel)
        return torch.ops.tollway_cpu.int4_matmul_q8(x, packed.weight, tile_scales, tile_mins, n, packed.group_size,
                                                    q8_kernel)

    if q8_kernel == "vnni" and native.q8_kernel() != "vnni":
        with pytest.raises(RuntimeError, match="AVX512-VNNI"):
            run(torch.randn(1, k))
        return
    w = dequantize(weight)
    mins = None if weight.mins is None else weight.mins.float().repeat_interleave(weight.group_size, dim=1)
    for m in range(1, 10):  # passes of 4 (AVX2) or 8 (VNNI) rows and every remainder
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
        x[0, 40:72] = 0  # a block of zeros: step 0
        x = x.to(dtype)
        out = run(x)
        assert out.dtype == dtype and out.shape == (m, n)
        if mins is None:
            expected = _q8_rounded(x) @ w.T
        else:  # scale * q rounds with x; min * sum(x) takes x as it is
            expected = _q8_rounded(x) @ (w - mins).T + x.float() @ mins.T
        bound = BOUND[dtype] * (x.float().abs() @ w.abs().T) + 1e-5
        assert ((out.float() - expected).abs() <= bound).all(), (m, (out.float() - expected).abs().max())
        assert not torch.allclose(out.float(), x.float() @ w.T, atol=1e-4)  # x was really rounded
        if q8_kernel == native.q8_kernel() and half_scales == (packed.q8_scales is not None):
            with decode_step():  # what cpu_matmul runs in a decode step
                if m < dequantize_from_rows(packed, rounded=True):
                    assert torch.equal(cpu_matmul(x, packed), out)
        if m < dequantize_from_rows(packed, rounded=False):  # outside one, the float row kernel (below the
            # crossover: an engine earlier in the process may have measured it under 10 rows on this CPU)
            exact = (torch.ops.tollway_cpu.int8_matmul(x, packed.weight, packed.scales, n) if bits == 8 else
                     torch.ops.tollway_cpu.int4_matmul(x, packed.weight, packed.scales, packed.mins, n,
                                                       packed.group_size))
            assert torch.equal(cpu_matmul(x, packed), exact)


def test_q8_ops_refuse_an_unknown_kernel() -> None:
    if not native.load():
        unavailable(str(native.unavailable_reason()))
    packed = pack_for_cpu(_weight(8, 8, 32, 32, seed=1), torch.float32, "native")
    with pytest.raises(RuntimeError, match="implementation must be auto, vnni or avx2"):
        torch.ops.tollway_cpu.int8_matmul_q8(torch.randn(1, 32), packed.weight, packed.scales, 8, "sse")
    with pytest.raises(ValueError, match="unknown activations 'int4'"):
        pack_for_cpu(_weight(8, 8, 32, 32, seed=1), torch.float32, "native", activations="int4")


def test_one_hot_rows_read_the_layout_s_weights_back(kernel: str) -> None:
    """In fp32 each kernel computes w = q * scale + min (torch: (q - 8) * scale + zero) to rounding."""
    weight = _weight(4, 64, 128, 32, seed=7)
    out = cpu_matmul(torch.eye(128), pack_for_cpu(weight, torch.float32, kernel))  # [K, N] = W.T
    torch.testing.assert_close(out.T, dequantize(weight), rtol=0, atol=1e-6)


def test_native_tiles_interleave_8_rows_and_pair_code_j_with_code_j_plus_16() -> None:
    codes = torch.randint(0, 16, (10, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    tiles = native_tiles(codes, 4)
    assert tiles.shape == (2, 4 * 64)  # 10 rows -> 2 tiles of 8 (6 zero rows); 2 blocks of 16 bytes a row
    def byte(t: int, b: int, c: int, j: int) -> int:
        return int(tiles[t].view(2, 8, 16)[b, c, j])
    assert byte(0, 0, 3, 5) == codes[3, 5] | (codes[3, 21] << 4)
    assert byte(1, 1, 1, 0) == codes[9, 32] | (codes[9, 48] << 4)
    assert byte(1, 0, 2, 7) == 0  # row 10: padding
    q8 = torch.randint(-127, 128, (9, 32), dtype=torch.int8)
    assert int(native_tiles(q8, 8).view(2, 2, 8, 16)[1, 1, 0, 3]) == q8[8, 19]


def test_int8_takes_one_group_per_row() -> None:
    grouped = QuantizedWeight(bits=8, qweight=torch.zeros(4, 64, dtype=torch.int8), scales=torch.ones(4, 2),
                              mins=None, group_size=32)
    with pytest.raises(ValueError, match="one scale per output channel"):
        pack_for_cpu(grouped, torch.float32)


def test_unsupported_groups_and_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="groups of 32, 64, 128, 256"):
        pack_for_cpu(_weight(4, 8, 64, 16, seed=0), torch.float32)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        pack_for_cpu(_weight(4, 8, 64, 32, seed=0), torch.float64)
    with pytest.raises(ValueError, match="native kernel takes fp32/bf16"):
        pack_for_cpu(_weight(4, 8, 64, 32, seed=0), torch.float16, "native")
    with pytest.raises(ValueError, match="unknown CPU kernel 'gpu'"):
        pack_for_cpu(_weight(4, 8, 64, 32, seed=0), torch.float32, "gpu")
    with pytest.raises(ValueError, match="out_features in multiples of 16, not 8"):
        pack_for_cpu(_weight(4, 8, 64, 32, seed=0), torch.float32, "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_native_dequantize_is_the_layout_s_dequantize(dtype: torch.dtype, bits: int) -> None:
    """What the native kernel multiplies from DEQUANTIZE_FROM_ROWS rows on: exactly dequantize()."""
    if not native.load():
        unavailable(str(native.unavailable_reason()))
    weight = _weight(bits, 48, 192, 64 if bits == 4 else 192, seed=3)
    got = dequantize_native(pack_for_cpu(weight, dtype, "native"))
    assert got.dtype == dtype and torch.equal(got, dequantize(weight, dtype))


@pytest.mark.cpu_isa
def test_without_avx512_bf16_the_tile_ops_refuse_and_bf16_matmuls_keep_the_row_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU the tile kernels cannot run on: their ops refuse by name, and cpu_matmul over bf16 x in the
    tile kernels' range of rows takes the other kernels, the product within the bf16 bound."""
    if not native.load():
        unavailable(str(native.unavailable_reason()))
    if native.tile_matmul_available():
        pytest.skip("this CPU runs the tile kernels (the tests below)")
    assert not bf16_kernels_expected(), "this CPU has AVX512-BF16, yet the tile kernels are unavailable"
    from kernels.quantized import cpu as qcpu

    packed8 = pack_for_cpu(_weight(8, 16, 64, 64, seed=2), torch.bfloat16, "native")
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        torch.ops.tollway_cpu.int8_tile_matmul(torch.randn(2, 64).bfloat16(), packed8.weight, packed8.scales, 16)
    weight = _weight(4, 64, 128, 32, seed=1)
    packed = pack_for_cpu(weight, torch.bfloat16, "native")
    calls: list[int] = []
    monkeypatch.setattr(torch.ops.tollway_cpu, "int4_tile_matmul", lambda x, *a: calls.append(x.shape[0]))
    x = torch.randn(qcpu.TILE_GEMM_MAX_ROWS, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = cpu_matmul(x, packed)
    w = dequantize(weight)
    bound = BOUND[torch.bfloat16] * (x.float().abs() @ w.abs().T) + 1e-6
    assert calls == [] and out.dtype == torch.bfloat16
    assert ((out.float() - F.linear(x.float(), w)).abs() <= bound).all()


@pytest.mark.cpu_isa
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(13, 64), (99, 1536)])  # groups of 32 columns cut short; a long K
@pytest.mark.parametrize("m", [1, 2, 5, 6, 13, 40])  # passes of 6 rows of x and the rest
def test_tile_matmul_is_the_dequantized_weights_product(bits: int, n: int, k: int, m: int) -> None:
    require_bf16_kernels()
    weight = _weight(bits, n, k, 32 if bits == 4 else k, seed=n + m)
    packed = pack_for_cpu(weight, torch.bfloat16, "native")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    if bits == 8:
        out = torch.ops.tollway_cpu.int8_tile_matmul(x, packed.weight, packed.scales, n)
    else:
        out = torch.ops.tollway_cpu.int4_tile_matmul(x, packed.weight, packed.scales, packed.mins, n, 32)
    w = dequantize_native(packed).float()  # the weights the tile kernel dequantizes, bf16 as that op rounds them
    expected = x.float() @ w.T
    bound = BOUND[torch.bfloat16] * (x.float().abs() @ w.abs().T) + 1e-6
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert ((out.float() - expected).abs() <= bound).all()


@pytest.mark.cpu_isa
def test_cpu_matmul_takes_the_tile_kernel_between_the_crossover_and_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.quantized import cpu as qcpu

    require_bf16_kernels()
    packed = pack_for_cpu(_weight(4, 64, 128, 32, seed=1), torch.bfloat16, "native")
    calls: list[int] = []
    tile = torch.ops.tollway_cpu.int4_tile_matmul
    monkeypatch.setattr(torch.ops.tollway_cpu, "int4_tile_matmul", lambda x, *a: calls.append(x.shape[0]) or tile(x, *a))
    crossover = dequantize_from_rows(packed, rounded=False)
    for rows in (crossover - 1, crossover, qcpu.TILE_GEMM_MAX_ROWS, qcpu.TILE_GEMM_MAX_ROWS + 1):
        cpu_matmul(torch.randn(rows, 128).bfloat16(), packed)
    assert calls == [crossover, qcpu.TILE_GEMM_MAX_ROWS]
    fp32 = pack_for_cpu(_weight(4, 64, 128, 32, seed=1), torch.float32, "native")
    assert not qcpu.tile_matmul_fits(fp32, torch.randn(32, 128))  # fp32 models keep their float kernels


@pytest.mark.cpu_isa
def test_tile_matmul_refuses_fp32_x() -> None:
    require_bf16_kernels()
    packed = pack_for_cpu(_weight(8, 16, 64, 64, seed=2), torch.bfloat16, "native")
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.tollway_cpu.int8_tile_matmul(torch.randn(2, 64), packed.weight, packed.scales, 16)
