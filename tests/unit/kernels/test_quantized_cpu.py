"""The CPU quantized matmuls (tollway's native ops and torch's weight-only ops) on the layout: the
same product as dequantize() + F.linear within the rounding of the op's dtype; clear errors."""

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import native
from kernels.quantized.cpu import (
    DEQUANTIZE_FROM_ROWS,
    cpu_matmul,
    dequantize_native,
    native_block_order,
    pack_for_cpu,
)
from kernels.quantized.layout import QuantizedWeight, dequantize, quantize_int4, quantize_int8, unpack_int4
from tests.required import unavailable

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
@pytest.mark.parametrize("m", [1, 5, DEQUANTIZE_FROM_ROWS - 1, 32])  # row kernel (4-row passes + rest), dequantize + GEMM
def test_cpu_matmul_matches_dequantize_then_linear(kernel: str, dtype: torch.dtype, bits: int,
                                                    group_size: int | None, m: int) -> None:
    n, k = (99 if kernel == "native" else 96), 256  # native: tiles of 8 and 4 weight rows, single-row tails
    weight = _weight(bits, n, k, group_size or k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m)).to(dtype)
    packed = pack_for_cpu(weight, dtype, kernel)
    assert packed.kernel == kernel
    out = cpu_matmul(x, packed)
    assert out.dtype == dtype and out.shape == (m, n)
    w = dequantize(weight)
    expected = F.linear(x.float(), w)
    bound = BOUND[dtype] * (x.float().abs() @ w.abs().T) + 1e-6
    assert ((out.float() - expected).abs() <= bound).all(), (out.float() - expected).abs().max()


def test_one_hot_rows_read_the_layout_s_weights_back(kernel: str) -> None:
    """In fp32 each kernel computes w = q * scale + min (torch: (q - 8) * scale + zero) to rounding."""
    weight = _weight(4, 64, 128, 32, seed=7)
    out = cpu_matmul(torch.eye(128), pack_for_cpu(weight, torch.float32, kernel))  # [K, N] = W.T
    torch.testing.assert_close(out.T, dequantize(weight), rtol=0, atol=1e-6)


def test_native_block_order_pairs_code_j_with_code_j_plus_16() -> None:
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)  # two blocks of 32
    packed = native_block_order(codes)
    assert packed.shape == (1, 32)
    assert packed[0, 0].item() == codes[0, 0].item() | (codes[0, 16].item() << 4)
    assert packed[0, 17].item() == codes[0, 33].item() | (codes[0, 49].item() << 4)
    assert torch.equal(unpack_int4(packed).view(1, 2, 16, 2).transpose(2, 3).reshape(1, 64), codes)


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
