"""Persistent block-table rows (workers/engine/table_rows.py): a step's rows always equal the tables'
block ids, a row is rewritten only when its table changed, and rows of collected tables are reused."""

from __future__ import annotations

import gc

import pytest
import torch

from cache.block_pool import BlockPool
from cache.block_table import BlockTable
from kernels.cpu import native
from kernels.metadata import PagedAttentionMetadata
from tests.required import unavailable
from workers.engine.table_rows import BlockTableRows


def expected_rows(tables: list[BlockTable]) -> list[list[int]]:
    width = max(len(t.block_ids) for t in tables)
    return [[max(b, 0) for b in t.block_ids] + [0] * (width - len(t.block_ids)) for t in tables]  # NO_BLOCK: 0


def test_rows_follow_appends_forks_and_releases_rewriting_only_changed_tables() -> None:
    pool = BlockPool(200, 4)
    mirror = BlockTableRows(rows=2, width=2)  # small: both dimensions must grow
    tables = [BlockTable(pool) for _ in range(3)]
    for table, n in zip(tables, (3, 9, 14), strict=True):
        table.append(n)
    assert mirror.gather(tables).tolist() == expected_rows(tables)
    assert mirror.num_rewrites == 3
    assert mirror.gather(tables).tolist() == expected_rows(tables)  # nothing changed: nothing written
    assert mirror.num_rewrites == 3
    tables[0].append(1)  # 4 tokens: still one block
    tables[1].append(4)  # 13 tokens: a fourth block
    assert mirror.gather(tables).tolist() == expected_rows(tables)
    assert mirror.num_rewrites == 4
    child = tables[2].fork()
    child.append(1)  # copy-on-write of the shared partial last block: the child's row changes
    assert mirror.gather([*tables, child]).tolist() == expected_rows([*tables, child])
    tables[1].release()
    tables[1].append(5)
    assert mirror.gather(tables).tolist() == expected_rows(tables)  # old entries past 2 blocks zeroed
    assert tables[2].drop_before(9) == 2  # a sliding window moved on: dropped slots read block 0
    rows = mirror.gather(tables).tolist()
    assert rows == expected_rows(tables) and rows[2][:2] == [0, 0] and min(min(r) for r in rows) == 0


def test_rows_of_collected_tables_are_reused() -> None:
    pool = BlockPool(64, 4)
    mirror = BlockTableRows(rows=4, width=4)
    first = [BlockTable(pool) for _ in range(4)]
    for t in first:
        t.append(5)
    mirror.gather(first)
    for t in first:
        t.release()
    del first, t
    gc.collect()
    second = [BlockTable(pool) for _ in range(4)]
    for t in second:
        t.append(2)
    assert mirror.gather(second).tolist() == expected_rows(second)
    assert mirror.rows.shape[0] == 4  # the four freed rows served the new tables


def test_from_tables_equals_build_for_mixed_steps() -> None:
    query_lens, context_lens, tables = [1, 1, 3, 6], [9, 1, 3, 14], [[7, 9, 4], [2], [5], [1, 3, 8, 6]]
    built = PagedAttentionMetadata.build(query_lens, context_lens, tables, block_size=4)
    padded = torch.tensor([t + [0] * (4 - len(t)) for t in tables], dtype=torch.int32)
    fast = PagedAttentionMetadata.from_tables(query_lens, context_lens, padded, block_size=4)
    for name in ("query_start", "context_lens", "slot_mapping", "positions"):
        assert torch.equal(getattr(fast, name), getattr(built, name)), name
    assert fast.num_decodes == built.num_decodes == 2
    assert fast.block_tables_list == [[7, 9, 4], [2], [5], [1, 3, 8, 6]]


@pytest.mark.parametrize("native_ops", [True, False])
def test_decode_metadata_equals_from_tables_over_the_gathered_rows(native_ops: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if native_ops and not native.load():
        unavailable(f"native ops unavailable: {native.unavailable_reason()}")
    if not native_ops:
        monkeypatch.setattr(native, "is_loaded", lambda: False)  # the torch fallback (a GPU's rows take it)
    pool = BlockPool(200, 4)
    mirror = BlockTableRows(rows=2, width=2)
    tables = [BlockTable(pool) for _ in range(4)]
    for table, n in zip(tables, (3, 9, 14, 4), strict=True):
        table.append(n)
    mirror.gather(tables[1:3])  # rows taken in another order than the step's
    context_lens = [3, 9, 14, 4]  # the newest token is the last slot held: in the last block, and a full one
    got = mirror.decode_metadata(tables, context_lens, 4, "native")
    expected = PagedAttentionMetadata.from_tables([1] * 4, context_lens, mirror.gather(tables), 4, backend="native")
    for name in ("query_start", "context_lens", "block_tables", "slot_mapping", "positions"):
        value, want = getattr(got, name), getattr(expected, name)
        assert value.dtype == want.dtype and torch.equal(value, want), name
    assert (got.num_decodes, got.query_lens_list, got.context_lens_list, got.backend) == (4, [1] * 4, context_lens,
                                                                                          "native")
    if native_ops:
        with pytest.raises(RuntimeError, match="does not fit"):
            mirror.decode_metadata(tables, [3, 9, 17, 4], 4, None)
