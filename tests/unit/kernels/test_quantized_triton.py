"""The Triton dequant-matmul (in Triton's CPU interpreter here; compiled on CUDA in the `gpu` tests)
against the fp32 reference x @ dequantize(W)^T + bias.

Weights are random codes with random positive scales (and, for int4, mins around -8 scales), sized
so outputs are O(1). fp32 inputs: within 1e-4 (abs and rel; only the summation order differs).
fp16/bf16 inputs: the kernel rounds each dequantized weight to x's dtype and the output too, each
off by at most one step eps (2^-10 fp16, 2^-7 bf16: the interpreter truncates where a GPU rounds),
so |got - expected| <= eps * (sum_k |x_k w_k| + |expected|) per element, plus fp32 noise; that bound
is about a tenth of the outputs' spread. A wrong nibble, group or scale moves outputs by O(1).
The default grid covers each value of each axis at least once; the full product is `slow`.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.quantized.layout import QuantizedWeight, dequantize, pack_int4, quantize_int4, quantize_int8
from kernels.quantized.triton_matmul import Blocks, choose_blocks, prepare_for_triton, quantized_matmul

PER_CHANNEL = 0  # group size placeholder: one group per row (group_size = K)
# (bits, M, N, K, group size, x dtype, bias): K/N off the block sizes; M 1 and 3 decode, 17 and 70 prefill
FAST_GRID = [
    (4, 1, 72, 96, 32, torch.float32, True),
    (4, 3, 100, 192, 64, torch.bfloat16, False),
    (4, 17, 40, 384, 128, torch.float32, False),
    (4, 17, 72, 288, 32, torch.bfloat16, True),
    (4, 3, 33, 144, 48, torch.float32, True),  # a group that is not a power of two
    (4, 70, 24, 256, 128, torch.float16, True),  # two M tiles
    (8, 1, 72, 200, PER_CHANNEL, torch.float32, True),
    (8, 3, 100, 96, PER_CHANNEL, torch.bfloat16, False),
    (8, 17, 40, 192, 64, torch.float32, True),
    (8, 17, 72, 288, 32, torch.bfloat16, False),
    (8, 3, 50, 384, 128, torch.float16, True),
    (8, 1, 48, 144, 48, torch.bfloat16, True),
    (8, 70, 24, 160, PER_CHANNEL, torch.float32, False),
]
SHAPES = {32: (72, 288), 64: (100, 192), 128: (40, 384), PER_CHANNEL: (33, 200)}  # group -> (N, K)
FULL_GRID = [
    (bits, m, *SHAPES[group], group, dtype, bias)
    for bits, m, group, dtype, bias in itertools.product(
        (4, 8), (1, 3, 17), (32, 64, 128, PER_CHANNEL), (torch.float32, torch.bfloat16), (False, True))
    if not (bits == 4 and group == PER_CHANNEL)
]
SLOW_GRID = [pytest.param(*case, marks=pytest.mark.slow) for case in FULL_GRID if case not in FAST_GRID]


FP32 = {"atol": 1e-4, "rtol": 1e-4}


def assert_matches_reference(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight,
                             bias: torch.Tensor | None) -> None:
    expected = reference(x, weight, bias)
    assert got.shape == expected.shape and got.dtype == x.dtype and got.device == x.device
    assert expected.abs().amax() > 0.5  # outputs are O(1): the bounds below are meaningful
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, expected, **FP32)
        return
    eps = torch.finfo(x.dtype).eps
    bound = eps * (x.float().abs() @ dequantize(weight).abs().T + expected.abs()) * 1.01 + 1e-4
    error = (got.float() - expected).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g} (bound there {bound[error > bound].min():.3g})"


def random_weight(bits: int, n: int, k: int, group: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    group = group or k
    scales = (torch.rand(n, k // group, generator=gen) + 0.5) * (0.6 / k**0.5)
    if bits == 8:
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return QuantizedWeight(bits=8, qweight=codes, scales=scales / 16, mins=None, group_size=group)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    mins = -8 * scales + 0.05 * torch.randn(n, k // group, generator=gen) / k**0.5
    return QuantizedWeight(bits=4, qweight=pack_int4(codes), scales=scales, mins=mins, group_size=group)


def reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ dequantize(weight).T
    return out if bias is None else out + bias.float()


def check(bits, m, n, k, group, dtype, with_bias, device: str = "cpu", seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    weight = prepare_for_triton(random_weight(bits, n, k, group, seed), device)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    bias = torch.randn(n, generator=gen).to(device=device, dtype=dtype) if with_bias else None
    assert_matches_reference(quantized_matmul(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize(("bits", "m", "n", "k", "group", "dtype", "with_bias"), [*FAST_GRID, *SLOW_GRID])
def test_quantized_matmul_matches_dequantized_reference(bits, m, n, k, group, dtype, with_bias) -> None:
    check(bits, m, n, k, group, dtype, with_bias, seed=m + k)


@pytest.mark.parametrize("bits", [4, 8])
def test_small_tiles_walk_many_k_and_n_tiles(bits: int) -> None:
    """Forced 16/32-wide tiles: several K tiles (the last one partial), groups straddling tiles."""
    weight = random_weight(bits, 40, 144, 48, seed=5)
    x = torch.randn(5, 144, generator=torch.Generator().manual_seed(6))
    assert_matches_reference(quantized_matmul(x, weight, blocks=Blocks(16, 16, 32)), x, weight, None)


def test_strided_x_and_fp16_scales() -> None:
    """x as a column slice of a wider tensor (row stride != K); scales and mins in fp16, whose
    own values the kernel must use (compared with the dequantized fp16-scaled weight)."""
    gen = torch.Generator().manual_seed(7)
    float_weight = torch.randn(64, 128, generator=gen) * 0.1
    wide = torch.randn(9, 200, generator=gen)
    x = wide[:, 40:168]
    assert not x.is_contiguous()
    for weight in (quantize_int4(float_weight, 32), quantize_int8(float_weight)):
        half = prepare_for_triton(weight, "cpu", torch.float16)
        assert half.scales.dtype == torch.float16 and half.qweight.is_contiguous()
        assert_matches_reference(quantized_matmul(x, half), x, half, None)


def test_empty_batch_gives_an_empty_result() -> None:
    weight = random_weight(4, 8, 64, 32)
    out = quantized_matmul(torch.zeros(0, 64), weight)
    assert out.shape == (0, 8)


def test_block_choice_fits_decode_and_prefill() -> None:
    assert choose_blocks(1, 960, 576, 4, 32) == Blocks(16, 16, 64, 4, 2)  # int4 decode: the H200 sweep's tiles
    assert choose_blocks(32, 3072, 576, 4, 32) == Blocks(32, 32, 64, 4, 2)
    assert choose_blocks(32, 576, 1536, 4, 32) == Blocks(16, 16, 128, 4, 2)
    assert choose_blocks(1, 576, 576, 8, 576) == Blocks(16, 32, 128)
    assert choose_blocks(200, 576, 576, 8, 576) == Blocks(64, 64, 64)
    assert choose_blocks(20, 576, 576, 4, 128).k == 128  # K tiles hold whole power-of-two groups
    assert choose_blocks(1, 576, 64, 4, 32).k == 64  # never past K's next power of two
    assert choose_blocks(1, 576, 32, 4, 32).k == 32  # nor below int4's floor


def test_bad_inputs_are_refused_with_clear_errors() -> None:
    weight = random_weight(4, 8, 64, 32)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        quantized_matmul(torch.zeros(2, 3, 64), weight)
    with pytest.raises(ValueError, match="features"):
        quantized_matmul(torch.zeros(2, 32), weight)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        quantized_matmul(torch.zeros(2, 64, dtype=torch.int32), weight)
    with pytest.raises(ValueError, match="bias"):
        quantized_matmul(torch.zeros(2, 64), weight, torch.zeros(7))
    with pytest.raises(ValueError, match="powers of two"):
        quantized_matmul(torch.zeros(2, 64), weight, blocks=Blocks(16, 16, 16))
    wrong_codes = QuantizedWeight(bits=4, qweight=weight.qweight.to(torch.int8), scales=weight.scales,
                                  mins=weight.mins, group_size=32)
    with pytest.raises(ValueError, match="codes"):
        quantized_matmul(torch.zeros(2, 64), wrong_codes)
    with pytest.raises(ValueError, match="scale_dtype"):
        prepare_for_triton(weight, "cpu", torch.int8)
    on_meta = prepare_for_triton(weight, "meta")
    with pytest.raises(ValueError, match="prepare_for_triton"):
        quantized_matmul(torch.zeros(2, 64), on_meta)


@pytest.mark.gpu
@pytest.mark.parametrize(("bits", "m", "n", "k", "group", "dtype", "with_bias"), FULL_GRID + FAST_GRID)
def test_quantized_matmul_on_gpu_matches_reference(bits, m, n, k, group, dtype, with_bias) -> None:
    check(bits, m, n, k, group, dtype, with_bias, device="cuda", seed=m + k)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (576, 576), (576, 3072), (1536, 576)])
@pytest.mark.parametrize("m", [1, 8, 32, 300])
def test_quantized_matmul_on_gpu_at_the_default_models_shapes(bits, k, n, m) -> None:
    check(bits, m, n, k, 32 if bits == 4 else PER_CHANNEL, torch.bfloat16, True, device="cuda", seed=m)
