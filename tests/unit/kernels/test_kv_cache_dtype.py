"""A KV cache narrower than the model (`TOLLWAY_KV_CACHE_DTYPE` float16 / bfloat16 under fp32): every
backend on a CPU stores K/V rounded to the cache's dtype and attends over exactly those rounded values,
so each must equal the reference run on the widened (fp32) copy of the same caches."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.cpu import native
from kernels.dispatch import paged_attention
from kernels.metadata import PagedAttentionMetadata
from tests.required import unavailable
from workers.precision import resolve_kv_cache_dtype

NARROW = [torch.float16, torch.bfloat16]
EXACT = {"atol": 1e-5, "rtol": 1e-5}  # fp32 compute on identical inputs: summation order only


def mixed_step(backend: str) -> tuple[list[int], list[int], list[list[int]], PagedAttentionMetadata]:
    """Two decodes and one 9-token extend over a 31-token prefix, in blocks of 16."""
    query_lens, context_lens, tables = [1, 1, 9], [18, 1, 40], [[0, 1], [2], [3, 4, 5]]
    return query_lens, context_lens, tables, PagedAttentionMetadata.build(query_lens, context_lens, tables, 16,
                                                                          backend=backend)


@pytest.mark.parametrize("kv_dtype", NARROW)
@pytest.mark.parametrize("backend", ["cpu", "native"])
def test_narrow_cache_step_equals_reference_on_the_widened_cache(kv_dtype: torch.dtype, backend: str) -> None:
    if backend == "native" and not native.load():
        unavailable(str(native.unavailable_reason()))
    torch.manual_seed(5)
    shape = (8, 16, 2, 64)
    caches = [torch.randn(shape).to(kv_dtype), torch.randn(shape).to(kv_dtype)]
    q, k, v = torch.randn(11, 6, 64), torch.randn(11, 2, 64), torch.randn(11, 2, 64)
    *_, meta = mixed_step(backend)
    narrow = [c.clone() for c in caches]
    got = paged_attention(q, k, v, *narrow, meta, 0.125)
    assert narrow[0].dtype == kv_dtype
    # the same step on fp32 copies of the caches, given the K/V rounded as the narrow cache stores them
    *_, ref_meta = mixed_step("reference")
    wide = [c.float() for c in caches]
    expected = paged_attention(q, k.to(kv_dtype).float(), v.to(kv_dtype).float(), *wide, ref_meta, 0.125)
    torch.testing.assert_close(got, expected, **EXACT)
    assert torch.equal(narrow[0].float(), wide[0]) and torch.equal(narrow[1].float(), wide[1])  # stored alike
    assert not torch.equal(narrow[0], caches[0])  # the step did write its K/V


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_native_paged_decode_widens_narrow_caches(kv_dtype: torch.dtype) -> None:
    if not native.load():
        unavailable(str(native.unavailable_reason()))
    torch.manual_seed(6)
    lengths = [1, 17, 200]
    tables = [[0], [1, 2, 3], list(range(4, 4 + 25))]
    meta = PagedAttentionMetadata.build([1] * 3, lengths, tables, 8)
    k_cache, v_cache = torch.randn(30, 8, 3, 64).to(kv_dtype), torch.randn(30, 8, 3, 64).to(kv_dtype)
    q = torch.randn(3, 9, 64)
    expected = reference.decode_attention(q, k_cache.float(), v_cache.float(), meta.block_tables,
                                          meta.context_lens, 0.125, None)
    got = torch.ops.tollway_cpu.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125, 0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, **EXACT)
    with pytest.raises(RuntimeError, match="caches must hold"):  # bf16 compute takes bf16 caches only
        torch.ops.tollway_cpu.paged_decode(q.bfloat16(), k_cache.half(), v_cache.half(), meta.block_tables,
                                           meta.context_lens, 0.125, 0)


@pytest.mark.parametrize("kv_dtype", NARROW)
def test_native_rotary_store_rounds_into_narrow_caches(kv_dtype: torch.dtype) -> None:
    if not native.load():
        unavailable(str(native.unavailable_reason()))
    torch.manual_seed(7)
    n, hq, hkv, d = 3, 9, 3, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d)
    angles = torch.rand(n, d // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    wide_k, wide_v = torch.zeros(2, 8, hkv, d), torch.zeros(2, 8, hkv, d)
    narrow_k, narrow_v = wide_k.to(kv_dtype), wide_v.to(kv_dtype)
    slots = torch.tensor([0, 9, 15])
    wide_qkv = qkv.clone()
    torch.ops.tollway_cpu.rotary_store(wide_qkv, cos, sin, wide_k, wide_v, slots, hq, hkv)
    torch.ops.tollway_cpu.rotary_store(qkv, cos, sin, narrow_k, narrow_v, slots, hq, hkv)
    assert torch.equal(qkv, wide_qkv)  # q and k rotate in fp32 either way
    assert torch.equal(narrow_k, wide_k.to(kv_dtype)) and torch.equal(narrow_v, wide_v.to(kv_dtype))
    assert int((narrow_k.view(-1, hkv, d) != 0).any(dim=(1, 2)).sum()) == 3


def test_native_covers_cache_dtypes() -> None:
    assert native.covers(64, 9, 3, torch.float32, torch.float16)
    assert native.covers(64, 9, 3, torch.float32, torch.bfloat16)
    assert native.covers(64, 9, 3, torch.bfloat16, None)
    assert not native.covers(64, 9, 3, torch.bfloat16, torch.float16)
    assert native.covers(64, 9, 3, torch.float32, torch.int8)
    assert native.covers(64, 9, 3, torch.bfloat16, torch.int8)
    assert not native.covers(64, 9, 3, torch.float32, torch.int16)


def test_resolve_kv_cache_dtype() -> None:
    assert resolve_kv_cache_dtype("model", torch.bfloat16, "cuda") == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32, "cpu") == torch.float16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, "cpu") == torch.bfloat16  # the model's own
    with pytest.raises(ValueError, match="fp32 model"):
        resolve_kv_cache_dtype("float16", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kv_cache_dtype("float16", torch.float32, "cuda")
    assert resolve_kv_cache_dtype("int8", torch.bfloat16, "cpu") == torch.int8
    assert resolve_kv_cache_dtype("int8", torch.float32, "cpu") == torch.int8
    assert resolve_kv_cache_dtype("int8", torch.bfloat16, "cuda") == torch.int8  # the Triton kernels read it too
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        resolve_kv_cache_dtype("int3", torch.float32, "cpu")
