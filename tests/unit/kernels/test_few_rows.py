"""The fp32 matmul of a few rows (`few_rows_linear`, kernels/cpu/native/few_rows.cpp) against `F.linear`, and
the native step's fp32 linear (workers/models/packed_linear.py) running it up to FEW_ROWS_MAX_ROWS rows and
`F.linear` past that.

Needs the library built on this machine, as tests/unit/kernels/test_native.py (skipped locally without
a compiler, failing under TOLLWAY_REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.required import require_native
from workers.models.packed_linear import FEW_ROWS_MAX_ROWS, PackedLinear, packing_kind


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    require_native()


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to fp32 rounding of sums taken in another order (K <= 1,536 terms of unit scale here)."""
    torch.testing.assert_close(got, want, atol=2e-5 * max(1.0, want.abs().max().item()), rtol=1e-5)


# Rows of x: 1..3 (the partial passes), 3k and 3k + 1 / 3k + 2; weight rows: tails of 1..3 past the tiles of 4;
# K: below one vector, not a multiple of 8 or 16 (the scalar tail), the model's 576 and 1,536.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 16, 32, 64])
@pytest.mark.parametrize(("n", "k"), [(1, 5), (3, 9), (5, 24), (6, 33), (7, 576), (960, 576), (576, 1536)])
def test_equals_f_linear(rows: int, n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, weight, bias = (torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator),
                       torch.randn(n, generator=generator))
    close(torch.ops.tollway_cpu.few_rows_linear(x, weight, None), F.linear(x, weight))
    close(torch.ops.tollway_cpu.few_rows_linear(x, weight, bias), F.linear(x, weight, bias))


def test_a_strided_x_zero_rows_and_bad_arguments() -> None:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(12, 40, generator=generator)
    wide = torch.randn(5, 80, generator=generator)
    strided = wide[:, ::2]  # every other column: not contiguous
    close(torch.ops.tollway_cpu.few_rows_linear(strided, weight, None), F.linear(strided, weight))
    assert torch.ops.tollway_cpu.few_rows_linear(torch.empty(0, 40), weight, None).shape == (0, 12)
    with pytest.raises(RuntimeError, match="fp32"):  # mixed dtypes (bf16 with bf16: test_few_rows_bf16.py)
        torch.ops.tollway_cpu.few_rows_linear(strided.bfloat16(), weight, None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and weight \[N, K\]"):
        torch.ops.tollway_cpu.few_rows_linear(torch.randn(5, 41), weight, None)
    with pytest.raises(RuntimeError, match="contiguous weight"):
        torch.ops.tollway_cpu.few_rows_linear(strided, torch.randn(40, 12).t(), None)


def test_packed_linear_runs_few_rows_up_to_its_limit_and_f_linear_past_it(few_rows_calls: list[int]) -> None:
    assert packing_kind(torch.float32) == "few_rows"  # the library is loaded (the fixture)
    generator = torch.Generator().manual_seed(3)
    linear = nn.Linear(96, 200)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=generator))
    packed = PackedLinear(linear, "few_rows")
    assert packed.packed is None  # no copy of the weight
    with torch.no_grad():
        for rows in (1, 32, FEW_ROWS_MAX_ROWS, FEW_ROWS_MAX_ROWS + 1, 300):
            x = torch.randn(rows, 96, generator=generator)
            close(packed(x), linear(x))
    assert few_rows_calls == [1, 32, FEW_ROWS_MAX_ROWS]
    assert packed.row_kernel_for(FEW_ROWS_MAX_ROWS) is not None and packed.row_kernel_for(FEW_ROWS_MAX_ROWS + 1) is None
