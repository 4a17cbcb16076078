"""The Triton kernels (in Triton's CPU interpreter here) and the CPU path against the torch reference.

Tolerances: fp32 outputs within 1e-5 (abs and rel) of the reference; bf16 within 2e-2 (outputs are
weighted means of N(0, 1) values, |x| < 4, where one bf16 step is at most 1.6e-2). Stores are exact.
The default grid covers every value of each axis at least once; the full product is `slow`.
"""

from __future__ import annotations

import importlib
import itertools
import random
from dataclasses import dataclass

import pytest
import torch

from kernels import cpu, reference
from kernels.dispatch import paged_attention, select_backend
from kernels.metadata import Backend, PagedAttentionMetadata

GROUPS, HEAD_DIMS, BLOCK_SIZES, DTYPES = (1, 3, 4), (64, 128), (16, 32), (torch.float32, torch.bfloat16)
# (q heads per KV head, head dim, block size, dtype, batch): each value of each axis at least once
FAST_GRID = [
    (1, 64, 16, torch.float32, 1),
    (3, 64, 32, torch.bfloat16, 5),
    (4, 128, 16, torch.bfloat16, 3),
    (3, 128, 32, torch.float32, 4),
]
FULL_GRID = [(*combo, batch) for combo in itertools.product(GROUPS, HEAD_DIMS, BLOCK_SIZES, DTYPES) for batch in (1, 5)]
SLOW_GRID = [pytest.param(*case, marks=pytest.mark.slow) for case in FULL_GRID if case not in FAST_GRID]
GRID = [*FAST_GRID, *SLOW_GRID]
NUM_KV_HEADS = 2
LENGTHS = (1, 2, 15, 16, 17, 33, 50, 64, 77)  # around and between block boundaries


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: PagedAttentionMetadata
    scale: float


def make_case(group: int, head_dim: int, block_size: int, dtype: torch.dtype, batch: int, decode: bool,
              seed: int = 0) -> Case:
    """A batch whose K/V (cached prefix and new tokens) is already stored in shuffled blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    if decode:
        query_lens = [1] * batch
        context_lens = [rng.choice(LENGTHS) for _ in range(batch)]
    else:  # prefixes include 0 (a fresh prefill) and new parts include 1
        prefixes = [rng.choice((0, 1, 15, 32, 47)) for _ in range(batch)]
        query_lens = [rng.choice((1, 7, 16, 20, 33)) for _ in range(batch)]
        context_lens = [p + n for p, n in zip(prefixes, query_lens, strict=True)]
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used : used + n])
        used += n
    meta = PagedAttentionMetadata.build(query_lens, context_lens, tables, block_size)
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    num_tokens = meta.num_tokens
    k = torch.randn(num_tokens, NUM_KV_HEADS, head_dim).to(dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, head_dim).to(dtype)
    reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    q = torch.randn(num_tokens, NUM_KV_HEADS * group, head_dim).to(dtype)
    return Case(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)


def triton_module(name: str):
    return importlib.import_module(f"kernels.triton.{name}")  # first-party: a failed import is a failure


@pytest.mark.parametrize(("group", "head_dim", "block_size", "dtype", "batch"), GRID)
@pytest.mark.parametrize("window", [None, 20])
def test_decode_matches_reference(group, head_dim, block_size, dtype, batch, window) -> None:
    c = make_case(group, head_dim, block_size, dtype, batch, decode=True, seed=batch + group)
    args = (c.q, c.k_cache, c.v_cache, c.meta.block_tables, c.meta.context_lens, c.scale, window)
    expected = reference.decode_attention(*args)
    torch.testing.assert_close(cpu.decode_attention(*args), expected, **tolerance(dtype))
    triton_decode = triton_module("decode")
    torch.testing.assert_close(triton_decode.decode_attention(*args), expected, **tolerance(dtype))
    # several splits per sequence, merged by log-sum-exp
    torch.testing.assert_close(triton_decode.decode_attention(*args, split_len=64), expected, **tolerance(dtype))


@pytest.mark.parametrize(("group", "head_dim", "block_size", "dtype", "batch"), GRID)
@pytest.mark.parametrize("window", [None, 20])
def test_extend_matches_reference(group, head_dim, block_size, dtype, batch, window) -> None:
    c = make_case(group, head_dim, block_size, dtype, batch, decode=False, seed=batch * group)
    args = (c.q, c.k_cache, c.v_cache, c.meta.block_tables, c.meta.query_start, c.meta.context_lens, c.scale, window)
    expected = reference.extend_attention(*args)
    torch.testing.assert_close(cpu.extend_attention(*args), expected, **tolerance(dtype))
    with_new_kv = cpu.extend_attention(*args, new_keys=c.k, new_values=c.v)  # fresh prefills skip the gather
    torch.testing.assert_close(with_new_kv, expected, **tolerance(dtype))
    triton_extend = triton_module("extend")
    torch.testing.assert_close(triton_extend.extend_attention(*args), expected, **tolerance(dtype))


@pytest.mark.parametrize(("group", "head_dim", "block_size", "dtype", "batch"), GRID)
def test_store_kv_writes_exact_rows(group, head_dim, block_size, dtype, batch) -> None:
    c = make_case(group, head_dim, block_size, dtype, batch, decode=False)
    k_new, v_new = torch.randn_like(c.k, dtype=torch.float32).to(dtype), torch.randn_like(c.v, dtype=torch.float32).to(dtype)
    expected_k, expected_v = c.k_cache.clone(), c.v_cache.clone()
    reference.store_kv(k_new, v_new, expected_k, expected_v, c.meta.slot_mapping)
    assert not torch.equal(expected_k, c.k_cache)  # the reference did write
    for store in (cpu.store_kv, triton_module("store").store_kv):
        k_cache, v_cache = c.k_cache.clone(), c.v_cache.clone()
        store(k_new, v_new, k_cache, v_cache, c.meta.slot_mapping)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_triton_store_skips_negative_slots() -> None:
    triton_store = triton_module("store")
    c = make_case(1, 64, 16, torch.float32, 2, decode=True)
    k_cache, v_cache = c.k_cache.clone(), c.v_cache.clone()
    slots = torch.full_like(c.meta.slot_mapping, -1)
    triton_store.store_kv(torch.zeros_like(c.k), torch.zeros_like(c.v), k_cache, v_cache, slots)
    assert torch.equal(k_cache, c.k_cache) and torch.equal(v_cache, c.v_cache)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_mixed_step_through_dispatch(backend: Backend) -> None:
    """Decodes and extends in one step: store, then each part to its op, in token order."""
    torch.manual_seed(3)
    block_size, head_dim = 16, 64
    query_lens, context_lens = [1, 1, 9, 20], [18, 1, 40, 20]
    tables = [[0, 1], [2], [3, 4, 5], [6, 7]]
    meta = PagedAttentionMetadata.build(query_lens, context_lens, tables, block_size)
    assert meta.num_decodes == 2
    shape = (8, block_size, NUM_KV_HEADS, head_dim)
    caches = [torch.randn(shape), torch.randn(shape)]
    q = torch.randn(meta.num_tokens, 3 * NUM_KV_HEADS, head_dim)
    k, v = torch.randn(meta.num_tokens, NUM_KV_HEADS, head_dim), torch.randn(meta.num_tokens, NUM_KV_HEADS, head_dim)

    def run(name: Backend) -> tuple[torch.Tensor, list[torch.Tensor]]:
        step_caches = [c.clone() for c in caches]
        fresh_meta = PagedAttentionMetadata.build(query_lens, context_lens, tables, block_size, backend=name)
        return paged_attention(q, k, v, *step_caches, fresh_meta, head_dim**-0.5), step_caches

    if backend == "triton":
        triton_module("ops")
    expected, expected_caches = run("reference")
    got, got_caches = run(backend)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, expected_caches, strict=True))


def test_backend_selection() -> None:
    from kernels.cpu import native

    assert select_backend(torch.device("cpu")) == ("native" if native.load() else "cpu")
    assert select_backend(torch.device("cpu"), "cpu") == "cpu"
    assert select_backend(torch.device("cuda")) == "triton"
    assert select_backend(torch.device("cuda"), "reference") == "reference"
    with pytest.raises(ValueError, match="TOLLWAY_ATTENTION"):
        select_backend(torch.device("cpu"), "flash")


def test_metadata_positions_and_slots() -> None:
    meta = PagedAttentionMetadata.build([1, 3], [5, 3], [[7, 9], [2]], block_size=4)
    assert meta.positions.tolist() == [4, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [9 * 4 + 0, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2]
    assert meta.num_decodes == 1
    with pytest.raises(ValueError, match="cannot hold"):
        PagedAttentionMetadata.build([1], [5], [[0]], block_size=4)
    with pytest.raises(ValueError, match="power of two"):
        PagedAttentionMetadata.build([1], [1], [[0]], block_size=12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3])
def test_cascade_decode_over_shared_prefixes_matches_reference(dtype, group: int) -> None:
    """Rows 0-2 share three blocks (row 2 only two before its newest token), rows 3-4 share one,
    row 5 shares nothing: the CPU decode reads each shared run once and merges exactly."""
    from kernels.cpu.cascade import plan_cascade

    torch.manual_seed(7)
    bs, head_dim = 16, 64
    tables = [[0, 1, 2, 3], [0, 1, 2, 4, 5], [0, 1, 2], [6, 7, 8], [6, 9], [10, 11]]
    lengths = [60, 70, 40, 40, 20, 30]
    meta = PagedAttentionMetadata.build([1] * 6, lengths, tables, bs)
    shape = (12, bs, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    q = torch.randn(6, NUM_KV_HEADS * group, head_dim).to(dtype)
    plan = plan_cascade(tables, lengths, bs, dtype, q.device)
    assert plan is not None and plan.num_groups == 2 and plan.max_members == 3
    expected = reference.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 0.125)
    got = cpu.decode_step(q, k_cache, v_cache, meta, 0.125, None)
    torch.testing.assert_close(got, expected, **tolerance(dtype))


def test_no_shared_blocks_means_no_cascade_plan() -> None:
    from kernels.cpu.cascade import plan_cascade

    assert plan_cascade([[0, 1], [2, 3]], [20, 30], 16, torch.float32, torch.device("cpu")) is None
    assert plan_cascade([[0, 1], [0, 3]], [10, 30], 16, torch.float32, torch.device("cpu")) is None  # row 0 in block 0
