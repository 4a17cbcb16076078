"""The bf16 matmul of up to 32 rows on AMX tiles (`amx_rows_linear`, kernels/cpu/native/few_rows_amx.cpp) against
the fp32 product rounded to bf16; its weight layout (`pack_amx_rows`, checked on any CPU); PackedLinear running
it for AMX_ROWS rows and oneDNN otherwise; and the decode step's one native call running it as the Python loop
does, bit-equal.

The kernel runs where the library is built for AVX512 on a CPU with AMX-BF16; on such a CPU its absence fails,
elsewhere those tests skip (marked `cpu_isa`) and one checks that the op refuses to run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kernels.cpu import native
from tests.required import require_native
from tests.unit.kernels.test_few_rows_bf16 import close_to_rounded
from workers.models import packed_linear
from workers.models.packed_linear import AMX_ROWS, PackedLinear, pack_amx_rows
from workers.precision import cpu_has_amx_bf16


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    require_native()


def require_amx_rows() -> None:
    """Skip unless `amx_rows_linear` runs here; fail where the CPU has AMX-BF16 under an AVX512 build."""
    if not native.amx_rows_available():
        expected = cpu_has_amx_bf16() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        assert not expected, "this CPU has AMX-BF16, yet amx_rows_linear is unavailable"
        pytest.skip("amx_rows_linear needs a CPU with AMX-BF16")


def test_pack_amx_rows_puts_each_weight_value_in_its_tile_slot() -> None:
    """packed[g, s, h, r, 2c + j] = weight[32g + 16h + c, 32s + 2r + j]: B tile (g, s, h) row r holds K pair
    (2r, 2r + 1) of the 16 columns of half h of column group g."""
    n, k = 64, 96
    weight = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    packed = pack_amx_rows(weight)
    assert packed.shape == (2, 3, 2, 16, 32) and packed.is_contiguous()
    g, s, h, r, c, j = torch.meshgrid(*(torch.arange(size) for size in (2, 3, 2, 16, 16, 2)), indexing="ij")
    want = weight[32 * g + 16 * h + c, 32 * s + 2 * r + j]
    assert torch.equal(packed.reshape(2, 3, 2, 16, 16, 2), want)


@pytest.mark.cpu_isa
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 20, 31, 32])  # one row tile of A and C, then two
@pytest.mark.parametrize(("n", "k"), [(32, 32), (96, 64), (960, 576), (576, 1536)])
def test_equals_the_fp32_product_rounded(rows: int, n: int, k: int) -> None:
    require_amx_rows()
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16()
    packed = pack_amx_rows(weight)
    close_to_rounded(torch.ops.tollway_cpu.amx_rows_linear(x, packed, None), x, weight)
    with_bias = torch.ops.tollway_cpu.amx_rows_linear(x, packed, bias)
    torch.testing.assert_close(with_bias, torch.ops.tollway_cpu.amx_rows_linear(x, packed, None) + bias)
    strided = torch.randn(rows, 2 * k, generator=generator).bfloat16()[:, ::2]
    close_to_rounded(torch.ops.tollway_cpu.amx_rows_linear(strided, packed, None), strided, weight)


@pytest.mark.cpu_isa
def test_bad_arguments_are_refused() -> None:
    require_amx_rows()
    packed = pack_amx_rows(torch.randn(64, 64).bfloat16())
    assert torch.ops.tollway_cpu.amx_rows_linear(torch.empty(0, 64).bfloat16(), packed, None).shape == (0, 64)
    with pytest.raises(RuntimeError, match="M <= 32"):
        torch.ops.tollway_cpu.amx_rows_linear(torch.randn(33, 64).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.tollway_cpu.amx_rows_linear(torch.randn(20, 64).bfloat16(), torch.randn(64, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bf16 x"):
        torch.ops.tollway_cpu.amx_rows_linear(torch.randn(20, 64), packed, None)


@pytest.mark.cpu_isa
def test_without_amx_the_op_refuses_to_run() -> None:
    if native.amx_rows_available():
        pytest.skip("this CPU runs the AMX kernel (the tests above)")
    packed = pack_amx_rows(torch.randn(32, 32).bfloat16())
    with pytest.raises(RuntimeError, match="AMX-BF16"):
        torch.ops.tollway_cpu.amx_rows_linear(torch.randn(20, 32).bfloat16(), packed, None)


@pytest.mark.cpu_isa
def test_packed_linear_runs_it_for_its_rows_and_onednn_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    require_amx_rows()
    calls: list[int] = []

    def counted(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return torch.ops.tollway_cpu.amx_rows_linear(x, packed, bias)

    generator = torch.Generator().manual_seed(9)
    linear = nn.Linear(96, 64, bias=False).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 96, generator=generator))
    packed = PackedLinear(linear, "mkldnn")
    assert packed.amx_packed is not None and packed.packed is not None  # oneDNN's copy stays for other rows
    monkeypatch.setattr(packed_linear, "_amx_rows_linear", counted)
    with torch.no_grad():
        for rows in (1, 16, 17, 32, 33, 300):
            x = torch.randn(rows, 96, generator=generator).bfloat16()
            close_to_rounded(packed(x), x, linear.weight)
    assert calls == [rows for rows in (1, 16, 17, 32, 33, 300) if rows in AMX_ROWS] == [1, 16, 17, 32]
    assert packed.row_kernel_for(32) is not None and packed.row_kernel_for(33) is None
    odd = PackedLinear(nn.Linear(96, 40, bias=False).bfloat16(), "mkldnn")
    assert odd.amx_packed is None and odd.row_kernel_for(32) is None  # 40 columns: not whole groups of 32


@pytest.mark.cpu_isa
def test_the_step_plan_runs_it_as_the_python_loop(tmp_path: Path) -> None:
    """5 and 20 sequences decode (one and two row tiles): the plan's `amx_rows_linear` entries give the Python
    loop's hidden states and K/V bit for bit."""
    require_amx_rows()
    from tests.unit.workers.test_layer_plan import both_ways, model_for, projection_kinds
    from workers.models.layer_plan import plan_for
    from workers.models.packed_linear import pack_linears

    model = model_for(tmp_path, torch.bfloat16, "none", "int8", None)
    assert pack_linears(model)
    for count in (5, 20):
        lengths = tuple(3 + 5 * i for i in range(count))
        plan = plan_for(model, count)
        assert plan is not None and set(projection_kinds(plan)) == {7}  # amx_rows_linear, every projection
        (plan_hidden, plan_kv), (loop_hidden, loop_kv) = both_ways(model, lengths)
        assert torch.equal(plan_hidden, loop_hidden)
        for a, b in zip(plan_kv, loop_kv, strict=True):
            assert torch.equal(a, b)
