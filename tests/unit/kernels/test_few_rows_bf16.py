"""The bf16 matmul of a few rows (`few_rows_linear` on bf16, kernels/cpu/native/few_rows_bf16.cpp) against
the fp32 product rounded to bf16, and the native step's bf16 linear (workers/models/packed_linear.py) running
it for BF16_FEW_ROWS rows (BF16_FEW_ROWS_HEAD in the LM head) and oneDNN's packed GEMM otherwise.

Runs where the library is built for AVX512 on a CPU with AVX512-BF16 (what `tile_matmul_available` reports);
on such a CPU its absence fails, elsewhere the tests skip and the last one checks the op refuses bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import native
from tests.required import require_bf16_kernels, require_native
from workers.models.packed_linear import BF16_FEW_ROWS, BF16_FEW_ROWS_HEAD, PackedLinear, pack_linears
from workers.precision import cpu_has_amx_bf16

pytestmark = pytest.mark.cpu_isa  # each test needs the CPU to have AVX512-BF16, or to lack it

@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    require_native()


def close_to_rounded(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """The exact products summed in fp32, then rounded once to bf16: within one bf16 step (2^-8 relative) of
    the fp32 product, plus fp32 summation-order noise near zero."""
    want = F.linear(x.float(), weight.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-4 * max(1.0, want.abs().max().item()))


# Rows: below 16 the dot products (2 or 4 rows a pass), then 16..64 across the four accumulator widths (1-4
# vectors of 16) and their padding; weight rows: tails past each tile of columns (8 or 4 below 16 rows, then
# 16, 12, 8, 6); K: the smallest pair and 6 (below one vector of 32), 64, the model's 576 and 1,536.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 48, 49, 64])
@pytest.mark.parametrize(("n", "k"), [(1, 2), (13, 6), (25, 64), (37, 576), (960, 576), (576, 1536)])
def test_equals_the_fp32_product_rounded(rows: int, n: int, k: int) -> None:
    require_bf16_kernels()
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16()
    close_to_rounded(torch.ops.tollway_cpu.few_rows_linear(x, weight, None), x, weight)
    with_bias = torch.ops.tollway_cpu.few_rows_linear(x, weight, bias)
    torch.testing.assert_close(with_bias, torch.ops.tollway_cpu.few_rows_linear(x, weight, None) + bias)


def test_a_strided_x_zero_rows_and_bad_arguments() -> None:
    require_bf16_kernels()
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(20, 40, generator=generator).bfloat16()
    strided = torch.randn(7, 80, generator=generator).bfloat16()[:, ::2]
    close_to_rounded(torch.ops.tollway_cpu.few_rows_linear(strided, weight, None), strided, weight)
    assert torch.ops.tollway_cpu.few_rows_linear(torch.empty(0, 40).bfloat16(), weight, None).shape == (0, 20)
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        torch.ops.tollway_cpu.few_rows_linear(torch.randn(65, 40).bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match="even K"):
        odd_k = torch.randn(4, 41).bfloat16()
        torch.ops.tollway_cpu.few_rows_linear(torch.randn(3, 41).bfloat16(), odd_k, None)
    with pytest.raises(RuntimeError, match="fp32 x and weight"):  # mixed dtypes
        torch.ops.tollway_cpu.few_rows_linear(torch.randn(3, 40), weight, None)


def test_packed_linear_runs_it_for_its_rows_and_onednn_otherwise(few_rows_calls: list[int]) -> None:
    require_bf16_kernels()
    if cpu_has_amx_bf16():
        pytest.skip("AMX CPUs keep oneDNN's kernels")
    generator = torch.Generator().manual_seed(9)
    linear = nn.Linear(96, 200, bias=False).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=generator))
    packed = PackedLinear(linear, "mkldnn")
    assert packed.bf16_few_rows and packed.packed is not None  # oneDNN's copy stays for the other row counts
    with torch.no_grad():
        for rows in (1, 4, 5, 15, 16, 32, 48, 49, 300):
            x = torch.randn(rows, 96, generator=generator).bfloat16()
            close_to_rounded(packed(x), x, linear.weight)
    assert few_rows_calls == [1, 4, 16, 32, 48]  # BF16_FEW_ROWS
    assert packed.row_kernel_for(32) is not None and packed.row_kernel_for(8) is None
    assert packed.row_kernel_for(49) is None
    head = PackedLinear(linear, "mkldnn", bf16_rows=BF16_FEW_ROWS_HEAD)  # one row: oneDNN in the LM head
    assert head.row_kernel_for(1) is None and head.row_kernel_for(32) is not None
    odd = PackedLinear(nn.Linear(95, 8, bias=False).bfloat16(), "mkldnn")
    assert not odd.bf16_few_rows and odd.row_kernel_for(32) is None  # an odd K stays on oneDNN


def test_without_avx512_bf16_the_op_refuses_bf16() -> None:
    if native.tile_matmul_available():
        pytest.skip("this CPU runs the bf16 kernel (the tests above)")
    weight = torch.randn(4, 8).bfloat16()
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        torch.ops.tollway_cpu.few_rows_linear(torch.randn(2, 8).bfloat16(), weight, None)


def test_pack_linears_gives_the_lm_head_its_own_rows(tmp_path: Path) -> None:
    require_bf16_kernels()
    from workers.models.loader import load_model
    from workers.models.tiny import write_tiny_model_folder

    model = load_model(write_tiny_model_folder(tmp_path / "m", seed=2), torch.bfloat16).model
    assert pack_linears(model)
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.bf16_rows == BF16_FEW_ROWS_HEAD
    projection = model.layers[0].qkv_proj
    assert isinstance(projection, PackedLinear) and projection.bf16_rows == BF16_FEW_ROWS
