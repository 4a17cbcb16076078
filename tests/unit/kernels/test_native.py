"""The native C++ CPU ops (kernels/cpu/native) against the torch reference and the eager ops they fuse.

They need the library built on this machine (a C++ compiler); without one the tests are skipped
locally and fail under TOLLWAY_REQUIRE_SERVICES=1 (tests/required.py), as CI runs them.
Tolerances as tests/unit/kernels/test_kernels.py: fp32 1e-5, bf16 2e-2.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.cpu import native
from kernels.dispatch import paged_attention
from kernels.metadata import PagedAttentionMetadata
from tests.required import require_native


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    require_native()


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def paged_batch(lengths: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
    """Caches holding sequences of `lengths` tokens in shuffled blocks, and one decode step's metadata."""
    torch.manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 2
    order = random.Random(seed).sample(range(num_blocks), num_blocks)
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n])
        used += n
    meta = PagedAttentionMetadata.build([1] * len(lengths), lengths, tables, block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), meta


# (group, head dim, block size, dtype): every value of each axis; contexts span up to 40 blocks. bf16 with
# AVX512-BF16 takes the pairwise bf16 V sum (odd lengths: a lone last token)
CASES = [
    (1, 16, 8, torch.float32), (3, 64, 8, torch.bfloat16), (3, 64, 16, torch.float32), (4, 128, 16, torch.bfloat16),
    (8, 32, 32, torch.float32), (2, 256, 4, torch.bfloat16), (7, 64, 1, torch.float32),
    (8, 32, 8, torch.bfloat16), (5, 64, 16, torch.bfloat16),  # bf16 passes of 4 heads and a lone one
]


@pytest.mark.parametrize(("group", "head_dim", "block_size", "dtype"), CASES)
@pytest.mark.parametrize("window", [None, 20])
def test_paged_decode_matches_reference(group: int, head_dim: int, block_size: int, dtype: torch.dtype,
                                        window: int | None) -> None:
    lengths = [1, 2, 15, 16, 17, 77, 321]
    k_cache, v_cache, meta = paged_batch(lengths, block_size, 2, head_dim, dtype, seed=group + head_dim)
    q = torch.randn(len(lengths), 2 * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    expected = reference.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, window)
    got = torch.ops.tollway_cpu.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                             window or 0)
    torch.testing.assert_close(got, expected, **tolerance(dtype))


@pytest.mark.parametrize("lengths", [[1, 2, 15, 16, 17, 77, 321], [77, 321]])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_decode_by_sequence_and_by_kv_head(lengths: list[int], threads: int) -> None:
    """A bf16 cache on vdpbf16ps products takes a task per sequence where there are at least two per thread
    (paged_decode_bf16.h), else a task per KV head (as always with fp32 products, paged_decode.h
    `bf16_decode_dots`): both give the reference's attention."""
    k_cache, v_cache, meta = paged_batch(lengths, 8, 3, 64, torch.bfloat16, seed=len(lengths) + threads)
    q = torch.randn(len(lengths), 9, 64).bfloat16()
    expected = reference.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.tollway_cpu.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125, 0)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, **tolerance(torch.bfloat16))


@pytest.mark.parametrize("dots", ["bf16", "fp32"])
def test_bf16_decode_rows_on_either_products(dots: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 q over a bf16 cache takes its products on vdpbf16ps or widened to fp32, as the CPU decides
    (paged_decode.h `bf16_decode_dots`): each, forced by TOLLWAY_DECODE_DOTS, gives the reference's attention
    (every bf16 case of CASES, and a batch by sequence and by KV head), whichever this machine picks by itself."""
    monkeypatch.setenv("TOLLWAY_DECODE_DOTS", dots)
    for group, head_dim, block_size, dtype in CASES:
        if dtype == torch.bfloat16:
            test_paged_decode_matches_reference(group, head_dim, block_size, dtype, None)
    for threads in (1, 2):
        test_paged_decode_by_sequence_and_by_kv_head([1, 2, 15, 16, 17, 77, 321], threads)


def test_decode_dots_switch_is_read_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOLLWAY_DECODE_DOTS is read on every paged_decode call (ops/bench/step_ab.py compares the two products in
    one process): where the CPU has AVX512-BF16 the two settings round differently (bf16 probabilities in the V
    sum), so one process sees two results; elsewhere both are the fp32 products, bit for bit."""
    k_cache, v_cache, meta = paged_batch([40, 77, 321, 5, 60], 8, 3, 64, torch.bfloat16, seed=9)
    q = torch.randn(5, 9, 64).bfloat16()
    outputs = {}
    for dots in ("bf16", "fp32", "bf16"):
        monkeypatch.setenv("TOLLWAY_DECODE_DOTS", dots)
        got = torch.ops.tollway_cpu.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125, 0)
        if dots in outputs:
            assert torch.equal(got, outputs[dots]), "the same setting gave two results"
        outputs[dots] = got
    # The library's own answer to "built for AVX512 on a CPU with AVX512-BF16" (bf16_dot_available in common.h).
    assert torch.equal(outputs["bf16"], outputs["fp32"]) != native.tile_matmul_available()


def test_paged_decode_reads_strided_queries() -> None:
    """q may be a view into the fused qkv rows (row stride > Hq * D), as the fused decode passes it."""
    k_cache, v_cache, meta = paged_batch([5, 40, 33], 16, 3, 64, torch.float32, seed=4)
    qkv = torch.randn(3, (9 + 6) * 64)
    q = qkv[:, : 9 * 64].view(3, 9, 64)
    expected = reference.decode_attention(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125)
    got = torch.ops.tollway_cpu.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125, 0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_native_backend_through_dispatch_matches_reference() -> None:
    """A mixed step on `native`: decodes on the C++ kernel, the extend on the CPU path."""
    torch.manual_seed(3)
    query_lens, context_lens, tables = [1, 1, 9], [18, 1, 40], [[0, 1], [2], [3, 4, 5]]
    shape = (8, 16, 2, 64)
    caches = [torch.randn(shape), torch.randn(shape)]
    q, k, v = torch.randn(11, 6, 64), torch.randn(11, 2, 64), torch.randn(11, 2, 64)
    results = []
    for backend in ("reference", "native"):
        meta = PagedAttentionMetadata.build(query_lens, context_lens, tables, 16, backend=backend)
        step_caches = [c.clone() for c in caches]
        results.append((paged_attention(q, k, v, *step_caches, meta, 0.125), step_caches))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def eager_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=eps).to(weight.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    residual, x = torch.randn(5, 576) * 3, torch.randn(5, 576).to(dtype)
    weight = (torch.rand(576) + 0.5).to(dtype)
    expected_residual = residual + x.float()
    expected = eager_norm(expected_residual, weight, 1e-5)
    got = torch.ops.tollway_cpu.add_rms_norm(residual, x, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)  # updated in place, exactly
    torch.testing.assert_close(got, expected, **tolerance(dtype))
    alone = torch.ops.tollway_cpu.add_rms_norm(residual.clone(), None, weight, 1e-5)  # no add
    torch.testing.assert_close(alone, expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_matches_eager(dtype: torch.dtype) -> None:
    from workers.models.rope import apply_rotary

    torch.manual_seed(1)
    n, hq, hkv, d = 4, 9, 3, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)
    angles = torch.rand(n, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    k_cache, v_cache = torch.zeros(4, 8, hkv, d, dtype=dtype), torch.zeros(4, 8, hkv, d, dtype=dtype)
    slots = torch.tensor([3, 9, -1, 31])
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    expected_q = apply_rotary(q.reshape(n, hq, d), cos[:, None], sin[:, None])
    expected_k = apply_rotary(k.reshape(n, hkv, d), cos[:, None], sin[:, None])
    expected_v = v.reshape(n, hkv, d).clone()
    torch.ops.tollway_cpu.rotary_store(qkv, cos, sin, k_cache, v_cache, slots, hq, hkv)
    assert torch.equal(qkv[:, : hq * d].view(n, hq, d), expected_q)  # same roundings as eager: exact
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], expected_k[token]) and torch.equal(flat_v[slot], expected_v[token])
    assert int((flat_k != 0).any(dim=(1, 2)).sum()) == 3  # the negative slot wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 100])  # a multiple of the vector width, and a ragged tail
def test_silu_mul_matches_eager(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(2)
    gate_up = (torch.randn(6, 2 * width) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = torch.ops.tollway_cpu.silu_mul(gate_up)
    exact = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got, expected, **exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_at_the_extremes(dtype: torch.dtype) -> None:
    """Gates whose exp(-x) overflows fp32 (x < -88.7) give silu 0, not NaN (x / inf, never inf / inf), and large
    ones silu x."""
    gate = torch.tensor([-1e4, -200.0, -89.0, -88.0, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 200.0, 1e4]
                        + [1.5] * 19)
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)]).unsqueeze(0).to(dtype)
    got = torch.ops.tollway_cpu.silu_mul(gate_up)
    expected = F.silu(gate_up[:, :32]) * gate_up[:, 32:]
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6 if dtype == torch.float32 else 1e-2)


def test_covers() -> None:
    assert native.covers(64, 9, 3, torch.bfloat16)
    assert not native.covers(80, 8, 8, torch.float32)  # head dim
    assert not native.covers(64, 16, 1, torch.float32)  # group of 16
    assert not native.covers(64, 8, 8, torch.float16)


def test_the_ops_split_their_work_over_torch_s_threads() -> None:
    """The ops parallelise with at::parallel_for, OpenMP pragmas compiled into the library: built
    without OpenMP, every op ran on one thread whatever torch.get_num_threads() said."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.tollway_cpu.parallel_threads(64) == 2
        torch.set_num_threads(1)
        assert torch.ops.tollway_cpu.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(before)
