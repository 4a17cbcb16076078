"""The int8 KV cache (kernels/kv_int8.py): rows of codes with an fp16 scale per 16 values. The round trip's
error bound; every CPU backend's step on an int8 cache against the reference on the dequantized (fp32) copy;
the native ops storing the same bytes as the torch path and reading them in place."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.dispatch import paged_attention
from kernels.kv_int8 import GROUP, as_stored, dequantize, quantize, row_width, scales
from kernels.metadata import PagedAttentionMetadata
from tests.required import require_native

EXACT = {"atol": 1e-5, "rtol": 1e-5}  # fp32 compute on identical (dequantized) inputs: summation order only


def needs_native() -> None:
    require_native()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step_of_its_group(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = (torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]).to(dtype)
    x[7, 1] = 0.0  # a row of zeros: scales 0, codes 0
    x[9, 2, 16:32] = 0.0  # a group of zeros in a row of others
    rows = quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 64 + 8) == (50, 3, row_width(64, torch.int8))
    groups = x.float().view(50, 3, 4, GROUP)
    scale = scales(rows)  # [50, 3, 4]: fp16(max |x| / 127) of each group of 16
    assert torch.equal(scale, (groups.abs().amax(-1) / 127).half().float())
    codes = rows[..., :64].view(50, 3, 4, GROUP)
    assert int(codes.min()) >= -127 and int(codes.max()) <= 127
    normal = scale >= 2**-14  # an fp16 scale off its subnormals is within 2^-11 of max / 127
    assert bool((codes.abs().amax(-1) == 127)[normal].all())  # each group's largest hits 127
    back = dequantize(rows, torch.float32).view(50, 3, 4, GROUP)
    error = (back - groups).abs()
    step = scale[..., None]  # a code is within half a step, or clamped at 127 steps where fp16 rounded s down
    assert bool((error <= torch.maximum(step / 2, groups.abs() - 127 * step) * (1 + 1e-5)).all())
    assert torch.equal(back[7, 1], torch.zeros(4, GROUP)) and torch.equal(back[9, 2, 1], torch.zeros(GROUP))


def test_a_group_s_step_is_set_by_its_own_values() -> None:
    """One large value in a head's row (rotary dimensions often carry them) no longer coarsens the other 48 of
    64: their errors stay under half a step of their own group's largest."""
    torch.manual_seed(2)
    x = torch.randn(64) * 0.1
    x[3] = 40.0
    back = dequantize(quantize(x), torch.float32)
    small = (back - x).abs()[GROUP:]
    assert float(small.max()) <= 0.5 * float(x[GROUP:].abs().max()) / 127 * (1 + 2**-10)
    assert float(small.max()) < 40.0 / 127 / 20  # a scale per 64-value row: steps of 40 / 127 for all of them


def mixed_step(backend: str) -> PagedAttentionMetadata:
    """Two decodes, one 9-token extend over a 31-token prefix and a fresh 12-token prompt, in blocks of 16.
    The fresh prompt is the cold prefill whose tokens a later prefix hit must reproduce: it has to attend
    over its K/V as the cache rounds them, not as computed (the reference reads everything back from the
    cache)."""
    return PagedAttentionMetadata.build([1, 1, 9, 12], [18, 1, 40, 12], [[0, 1], [2], [3, 4, 5], [6]], 16,
                                        backend=backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "cpu", "native", "triton"])
def test_step_on_an_int8_cache_equals_the_reference_on_its_dequantized_copy(dtype: torch.dtype, backend: str) -> None:
    if backend == "native":
        needs_native()
    torch.manual_seed(5)
    caches = [quantize(torch.randn(8, 16, 2, 64)), quantize(torch.randn(8, 16, 2, 64))]
    q, k, v = (torch.randn(23, h, 64).to(dtype) for h in (6, 2, 2))
    stored = [c.clone() for c in caches]
    got = paged_attention(q, k, v, *stored, mixed_step(backend), 0.125)
    wide = [dequantize(c, torch.float32) for c in caches]
    expected = paged_attention(q.float(), as_stored(k.float(), stored[0]), as_stored(v.float(), stored[1]), *wide,
                               mixed_step("reference"), 0.125)  # fp32 compute on the K/V as the int8 cache holds them
    tolerance = EXACT if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # bf16 q and outputs
    torch.testing.assert_close(got.float(), expected, **tolerance)
    slots = mixed_step(backend).slot_mapping
    assert torch.equal(stored[0].view(-1, 2, row_width(64, torch.int8))[slots], quantize(k))  # stored as quantize() says
    assert torch.equal(dequantize(stored[1], torch.float32), wide[1])  # the reference's step wrote the same values


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 50])
def test_native_paged_decode_reads_int8_rows_in_place(head_dim: int, dtype: torch.dtype, window: int) -> None:
    needs_native()
    torch.manual_seed(6)
    lengths = [1, 17, 200]
    tables = [[0], [1, 2, 3], list(range(4, 4 + 25))]
    meta = PagedAttentionMetadata.build([1] * 3, lengths, tables, 8)
    k_cache, v_cache = quantize(torch.randn(30, 8, 3, head_dim) * 3), quantize(torch.randn(30, 8, 3, head_dim))
    q = torch.randn(3, 9, head_dim).to(dtype)
    expected = reference.decode_attention(q.float(), dequantize(k_cache, torch.float32),
                                          dequantize(v_cache, torch.float32), meta.block_tables, meta.context_lens,
                                          0.125, window or None)
    got = torch.ops.tollway_cpu.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125, window)
    assert got.dtype == dtype
    tolerance = EXACT if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}  # the output rounded to bf16
    torch.testing.assert_close(got.float(), expected, **tolerance)
    with pytest.raises(RuntimeError, match="head_dim"):  # rows without their scales
        torch.ops.tollway_cpu.paged_decode(q, k_cache[..., :head_dim].contiguous(), v_cache[..., :head_dim].contiguous(),
                                           meta.block_tables, meta.context_lens, 0.125, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rotary_store_writes_the_bytes_quantize_writes(dtype: torch.dtype) -> None:
    needs_native()
    torch.manual_seed(7)
    n, hq, hkv, d = 3, 9, 3, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)
    angles = torch.rand(n, d // 2) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    wide_k, wide_v = torch.zeros(2, 8, hkv, d, dtype=dtype), torch.zeros(2, 8, hkv, d, dtype=dtype)
    int8_k, int8_v = (torch.zeros(2, 8, hkv, row_width(d, torch.int8), dtype=torch.int8) for _ in range(2))
    slots = torch.tensor([0, 9, 15])
    wide_qkv = qkv.clone()
    torch.ops.tollway_cpu.rotary_store(wide_qkv, cos, sin, wide_k, wide_v, slots, hq, hkv)
    torch.ops.tollway_cpu.rotary_store(qkv, cos, sin, int8_k, int8_v, slots, hq, hkv)
    assert torch.equal(qkv, wide_qkv)  # q and k rotate alike whatever the cache
    assert torch.equal(int8_k, quantize(wide_k)) and torch.equal(int8_v, quantize(wide_v))
    assert int((int8_k.view(-1, hkv, row_width(d, torch.int8)) != 0).any(dim=(1, 2)).sum()) == 3  # three slots written


def test_cpu_cascade_over_a_shared_prefix_reads_an_int8_cache() -> None:
    """Decodes sharing their first blocks: the CPU backend reads the shared blocks once (cascade.py)."""
    torch.manual_seed(8)
    tables, lengths = [[0, 1, 2], [0, 1, 3], [0, 1, 4]], [40, 35, 45]
    meta = PagedAttentionMetadata.build([1] * 3, lengths, tables, 16, backend="cpu")
    caches = [quantize(torch.randn(6, 16, 2, 64)), quantize(torch.randn(6, 16, 2, 64))]
    q, k, v = torch.randn(3, 6, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    got = paged_attention(q, k, v, *caches, meta, 0.125)
    assert any(key[0] == "cpu-cascade" and plan is not None for key, plan in meta.prepared.items())
    wide = [dequantize(c, torch.float32) for c in caches]
    expected = paged_attention(q, as_stored(k, caches[0]), as_stored(v, caches[1]), *wide, PagedAttentionMetadata.build([1] * 3, lengths, tables, 16,
                                                                            backend="reference"), 0.125)
    torch.testing.assert_close(got, expected, **EXACT)


def test_triton_store_rounds_as_quantize_does_ties_included() -> None:
    """Rows whose largest value is 127 have scale 1: their codes are x rounded, ties to even, and a value a
    hair under a half must not round up (0.49999997 + 0.5 is 1.0 in fp32)."""
    from kernels.triton.store import store_kv

    halves = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 3.5000002, -126.5])
    k = torch.zeros(2, 1, 16)
    k[0, 0, :10] = halves
    k[1, 0] = torch.randn(16) * 1e-3  # a small row: its own scale
    v = -k
    k_cache, v_cache = (torch.zeros(2, 4, 1, row_width(16, torch.int8), dtype=torch.int8) for _ in range(2))
    store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1]))  # the second token is padding: not stored
    assert torch.equal(k_cache[1, 1], quantize(k[0])) and torch.equal(v_cache[1, 1], quantize(v[0]))
    assert k_cache[1, 1, 0, :10].tolist() == [127, 0, 2, 2, 0, -2, -2, 0, 4, -126]
    assert int(k_cache.count_nonzero()) == int(k_cache[1, 1].count_nonzero())  # nothing else written
    store_kv(k, v, k_cache, v_cache, torch.tensor([5, 2]))
    assert torch.equal(k_cache[0, 2], quantize(k[1])) and torch.equal(v_cache[0, 2], quantize(v[1]))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [0, 50])
def test_triton_decode_and_extend_read_int8_rows(head_dim: int, window: int) -> None:
    from kernels.triton.decode import decode_attention
    from kernels.triton.extend import extend_attention

    torch.manual_seed(9)
    lengths = [1, 17, 200]
    tables = torch.tensor([[0] + [0] * 24, [1, 2, 3] + [0] * 22, list(range(4, 29))], dtype=torch.int32)
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    k_cache, v_cache = quantize(torch.randn(30, 8, 3, head_dim) * 3), quantize(torch.randn(30, 8, 3, head_dim))
    wide_k, wide_v = dequantize(k_cache, torch.float32), dequantize(v_cache, torch.float32)
    q = torch.randn(3, 9, head_dim)
    got = decode_attention(q, k_cache, v_cache, tables, context_lens, 0.125, window or None, split_len=64)
    expected = reference.decode_attention(q, wide_k, wide_v, tables, context_lens, 0.125, window or None)
    torch.testing.assert_close(got, expected, **EXACT)
    # the last 9 tokens of the longest sequence as one extend over its first 191
    q_new = torch.randn(9, 9, head_dim)
    start = torch.tensor([0, 9], dtype=torch.int32)
    got = extend_attention(q_new, k_cache, v_cache, tables[2:], start, context_lens[2:], 0.125, window or None)
    expected = reference.extend_attention(q_new, wide_k, wide_v, tables[2:], start, context_lens[2:], 0.125,
                                          window or None)
    torch.testing.assert_close(got, expected, **EXACT)
