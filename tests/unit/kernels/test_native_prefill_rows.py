"""`paged_decode`'s prefill runs (kernels/cpu/native/paged_prefill.h, paged_prefill_bf16.h, paged_prefill_amx.h)
against the torch reference.

Under an fp32 q (or a bf16 q over a bf16 cache on AVX512-BF16), consecutive rows that are one sequence's consecutive
tokens (each row one longer, reading the same blocks) attend as tiles; every other row as before. Each row's result must be the reference's attention over its
own table and length, whatever the batch around it holds: a run beside decode rows, runs shorter than the tile
threshold, a neighbour that shares a prefix's blocks but not the next block, a sliding window.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels import reference
from kernels.kv_int8 import dequantize, quantize
from tests.required import require_bf16_kernels, require_native
from tests.unit.kernels.test_few_rows_amx import require_amx_rows

EXACT = {"atol": 1e-5, "rtol": 1e-5}
BF16 = {"atol": 2e-2, "rtol": 2e-2}  # a bf16 output's rounding (2^-9 relative) and the probabilities' (the same)


@pytest.fixture(scope="module", autouse=True)
def native_ops() -> None:
    require_native()


class Batch:
    """Rows of a step over one shuffled cache: each row (sequence, position) reads its sequence's table up to
    position + 1 tokens."""

    def __init__(self, blocks_per_sequence: dict[str, int], block_size: int, seed: int) -> None:
        total = sum(blocks_per_sequence.values()) + 2
        order = random.Random(seed).sample(range(total), total)
        self.block_size, self.num_blocks, self.tables, used = block_size, total, {}, 0
        for name, count in blocks_per_sequence.items():
            self.tables[name] = order[used : used + count]
            used += count
        self.rows: list[tuple[str, int]] = []

    def prefill(self, name: str, start: int, stop: int) -> Batch:
        self.rows += [(name, position) for position in range(start, stop)]
        return self

    def decode(self, name: str, position: int) -> Batch:
        self.rows.append((name, position))
        return self

    def metadata(self) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(table) for table in self.tables.values())
        tables = [self.tables[name] + [0] * (width - len(self.tables[name])) for name, _ in self.rows]
        lens = [position + 1 for _, position in self.rows]
        return torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def attend(batch: Batch, group: int, head_dim: int, cache_dtype: torch.dtype, window: int = 0,
           seed: int = 0, q_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged_decode's output, the reference's) for the batch's rows with 2 KV heads."""
    torch.manual_seed(seed)
    shape = (batch.num_blocks, batch.block_size, 2, head_dim)
    keys, values = torch.randn(shape), torch.randn(shape)
    if cache_dtype == torch.int8:
        k_cache, v_cache = quantize(keys), quantize(values)
        k_wide, v_wide = dequantize(k_cache, torch.float32), dequantize(v_cache, torch.float32)
    else:
        k_cache, v_cache = keys.to(cache_dtype), values.to(cache_dtype)
        k_wide, v_wide = k_cache.float(), v_cache.float()
    tables, lens = batch.metadata()
    q = torch.randn(len(batch.rows), 2 * group, head_dim).to(q_dtype)
    scale = head_dim**-0.5
    got = torch.ops.tollway_cpu.paged_decode(q, k_cache, v_cache, tables, lens, scale, window)
    expected = reference.decode_attention(q.float(), k_wide, v_wide, tables, lens, scale, window or None)
    return got.float(), expected


def mixed_batch(block_size: int, seed: int) -> Batch:
    blocks = -(-300 // block_size)
    return (Batch({"a": blocks, "b": blocks, "c": blocks}, block_size, seed=seed)
            .decode("c", 140)
            .prefill("a", 37, 97)   # a chunk mid-prompt: 60 rows, tiles of 16 and a ragged last one
            .prefill("b", 0, 21)    # a prompt's first chunk, starting at position 0
            .decode("a", 12)        # the run's sequence again, as a decode row: its own row
            .prefill("c", 200, 205))  # 5 rows: under the tile threshold, rows as before


@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(3, 64, 8), (1, 16, 16), (4, 128, 4), (8, 32, 1),
                                                               (2, 256, 8)])
def test_prefill_runs_match_the_reference(group: int, head_dim: int, block_size: int) -> None:
    got, expected = attend(mixed_batch(block_size, seed=group), group, head_dim, torch.float32, seed=head_dim)
    torch.testing.assert_close(got, expected, **EXACT)


@pytest.mark.cpu_isa
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(3, 64, 8), (1, 32, 16), (4, 128, 4), (8, 32, 1),
                                                               (2, 256, 8), (1, 16, 16)])
def test_bf16_prefill_runs_match_the_reference(group: int, head_dim: int, block_size: int) -> None:
    """A bf16 q over a bf16 cache: the tiles on vdpbf16ps (64 dims a V pass, or 32; head_dim 16 stays rows),
    every row to bf16's rounding of the fp32 reference over the same bf16 values."""
    require_bf16_kernels()
    got, expected = attend(mixed_batch(block_size, seed=group), group, head_dim, torch.bfloat16, seed=head_dim,
                           q_dtype=torch.bfloat16)
    torch.testing.assert_close(got, expected, **BF16)


@pytest.mark.cpu_isa
def test_bf16_prefill_runs_over_long_contexts() -> None:
    """Chunks past 1,000 tokens (what workers/models/fused_decode.py sends as rows up to BF16_TILES_MAX_CONTEXT):
    K^T and the score rows as long, a chunk whose tiles start mid-block."""
    require_bf16_kernels()
    batch = Batch({"a": 140, "b": 140}, 8, seed=12).prefill("a", 900, 1100).prefill("b", 1003, 1040).decode("a", 700)
    got, expected = attend(batch, 3, 64, torch.bfloat16, seed=12, q_dtype=torch.bfloat16)
    torch.testing.assert_close(got, expected, **BF16)


@pytest.mark.cpu_isa
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(3, 64, 8), (1, 64, 16), (4, 128, 4), (8, 64, 1),
                                                               (2, 256, 8)])
def test_bf16_prefill_runs_on_amx_tiles_and_on_vdpbf16ps_match_the_reference(
        group: int, head_dim: int, block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has AMX-BF16 a bf16 run's tiles take TDPBF16PS (paged_prefill_amx.h; head dims of whole 64s),
    unless TOLLWAY_PREFILL_PRODUCTS=bf16 asks for vdpbf16ps: both to bf16's rounding of the reference, and not
    bit-equal to each other (the tile unit sums in its own order: if they are equal, one path did not run)."""
    require_amx_rows()
    batch = mixed_batch(block_size, seed=group).prefill("b", 21, 300)  # and a run past 256 keys (a 64-key pass)
    amx, expected = attend(batch, group, head_dim, torch.bfloat16, seed=head_dim, q_dtype=torch.bfloat16)
    monkeypatch.setenv("TOLLWAY_PREFILL_PRODUCTS", "bf16")
    dots, _ = attend(batch, group, head_dim, torch.bfloat16, seed=head_dim, q_dtype=torch.bfloat16)
    torch.testing.assert_close(amx, expected, **BF16)
    torch.testing.assert_close(dots, expected, **BF16)
    assert not torch.equal(amx, dots)


@pytest.mark.cpu_isa
def test_amx_tiles_over_threads_and_ragged_runs() -> None:
    """Runs of every length from the tile threshold up, beside decode rows, on 1-3 threads: each task's K^T and
    V pairs are the thread's own, its last 16-row tile ragged (G = 3: 64 tokens are 192 rows, 9 tokens 27)."""
    require_amx_rows()
    batch = Batch({"a": 60, "b": 60, "c": 60}, 8, seed=21).prefill("a", 0, 9).decode("b", 100).prefill(
        "b", 130, 201).prefill("c", 250, 470)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got, expected = attend(batch, 3, 64, torch.bfloat16, seed=threads, q_dtype=torch.bfloat16)
            torch.testing.assert_close(got, expected, **BF16)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(3, 64, 8), (1, 16, 16), (4, 128, 4), (2, 256, 8)])
def test_bf16_prefill_runs_over_an_int8_cache_match_the_reference(group: int, head_dim: int, block_size: int) -> None:
    """A bf16 q over an int8 cache goes as the fp32 tiles (its rows widened to fp32, as its decode rows are) on
    any vector unit, head dims of whole 2W lanes (16 stays rows on AVX512): every row to bf16's rounding of the
    fp32 reference over the dequantized cache."""
    got, expected = attend(mixed_batch(block_size, seed=group), group, head_dim, torch.int8, seed=head_dim,
                           q_dtype=torch.bfloat16)
    torch.testing.assert_close(got, expected, **BF16)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.int8])
def test_prefill_runs_widen_narrow_caches(cache_dtype: torch.dtype) -> None:
    batch = Batch({"a": 40, "b": 40}, 8, seed=3).prefill("a", 100, 300).decode("b", 250)
    got, expected = attend(batch, 3, 64, cache_dtype, seed=5)
    torch.testing.assert_close(got, expected, **EXACT)


def test_a_neighbour_sharing_a_prefix_is_not_merged_into_the_run() -> None:
    """Row 1 is one longer than row 0 and shares its first blocks, but its last block is its own: it must read
    that block, not row 0's."""
    batch = Batch({"a": 7, "b": 7}, 8, seed=9)
    batch.tables["b"][:5] = batch.tables["a"][:5]  # blocks 0-4 (positions 0-39) shared, as a prefix hit's
    batch.prefill("a", 20, 40).prefill("b", 40, 50)  # b's first row reads its own block 5 (position 40)
    got, expected = attend(batch, 3, 64, torch.float32, seed=11)
    torch.testing.assert_close(got, expected, **EXACT)


def test_a_sliding_window_keeps_rows() -> None:
    batch = Batch({"a": 30}, 8, seed=2).prefill("a", 150, 200)
    got, expected = attend(batch, 3, 64, torch.float32, window=40, seed=2)
    torch.testing.assert_close(got, expected, **EXACT)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefill_tiles_over_threads(threads: int) -> None:
    batch = Batch({"a": 48, "b": 48, "c": 48}, 8, seed=4).prefill("a", 0, 380).prefill("b", 0, 380).prefill(
        "c", 0, 264)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, expected = attend(batch, 3, 64, torch.float32, seed=threads)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, **EXACT)


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.int8),
                                                   pytest.param(torch.bfloat16, torch.bfloat16, marks=pytest.mark.cpu_isa)])
def test_a_run_takes_the_tile_path(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """The tiles sum in another order than a row alone does: a run's outputs are close to, but not bit-equal
    with, the same rows sent one at a time (each then a decode row). If this fails, the run went as rows."""
    if cache_dtype == torch.bfloat16:
        require_bf16_kernels()
    batch = Batch({"a": 20, "b": 50}, 8, seed=6).prefill("a", 60, 124).prefill("b", 0, 380)
    torch.manual_seed(6)
    k_cache, v_cache = torch.randn(batch.num_blocks, 8, 2, 64), torch.randn(batch.num_blocks, 8, 2, 64)
    if cache_dtype == torch.int8:
        k_cache, v_cache = quantize(k_cache), quantize(v_cache)
    else:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    tables, lens = batch.metadata()
    q = torch.randn(len(batch.rows), 6, 64).to(dtype)
    together = torch.ops.tollway_cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, 0)
    alone = torch.cat([torch.ops.tollway_cpu.paged_decode(q[i : i + 1], k_cache, v_cache, tables[i : i + 1],
                                                          lens[i : i + 1], 0.125, 0) for i in range(len(lens))])
    torch.testing.assert_close(together.float(), alone.float(), **(EXACT if dtype == torch.float32 else BF16))
    assert not torch.equal(together, alone)
