"""A sequence's block table: the ordered blocks holding its KV, one pool reference per block.

Forking (parallel sampling, `n > 1`) shares every block with the child by reference. Full blocks
are never written again, so sharing them is free; a shared, partly filled last block is copied
before the first write to it (copy-on-write), and the copy is returned for the KV storage to do.

`version` counts the changes to `block_ids` (blocks added, a block replaced by its copy, blocks
dropped or all released): a mirror of the table (the engine's persistent block-table rows) is
current exactly when it saw the same version.

Sliding windows: when the table's layers attend only to the last `window` keys, the blocks wholly
before a sequence's window are given back with `drop_out_of_window` (`drop_before`). Their slots keep their places in
`block_ids` as `NO_BLOCK` (so position p still lives in block_ids[p // block_size]); the dropped
slots are always a prefix, `num_dropped` long, and hold no pool reference. Attention never reads
them (they are outside every query's window); mirrors write them as block 0, real memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache.block_pool import BlockPool

NO_BLOCK = -1  # a slot whose block was given back because it left the sliding window


class BlockTable:
    def __init__(self, pool: BlockPool, block_ids: Sequence[int] = (), num_tokens: int = 0,
                 window: int | None = None) -> None:
        """Adopt `block_ids` (the caller hands over one reference on each) covering num_tokens.
        `window`: the sliding window of the layers the table serves (None: they see everything)."""
        if pool.blocks_for(num_tokens) > len(block_ids):
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens")
        self.pool = pool
        self.window = window
        self.block_ids = list(block_ids)
        self.num_tokens = num_tokens
        self.num_dropped = next((i for i, b in enumerate(self.block_ids) if b != NO_BLOCK), len(self.block_ids))
        self.version = 0

    @property
    def groups(self) -> list[BlockTable]:
        """One table per layer group (cache/kv_layout.py): this one alone (GroupedBlockTable has more)."""
        return [self]

    @property
    def held_ids(self) -> list[int]:
        """The blocks the table holds a reference on (every slot but the dropped prefix)."""
        return self.block_ids[self.num_dropped:]

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks `append(num_new_tokens)` would allocate (including a copy-on-write copy)."""
        new = self.pool.blocks_for(self.num_tokens + num_new_tokens) - len(self.block_ids)
        return max(new, 0) + (num_new_tokens > 0 and self._last_block_is_shared())

    def append(self, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for num_new_tokens more tokens; returns (src, dst) block copies to perform.

        Raises OutOfBlocksError with the table unchanged when the pool cannot supply the blocks.
        """
        needed = self.blocks_needed(num_new_tokens)
        return self.append_with(num_new_tokens, self.pool.allocate(needed) if needed else [])

    def append_with(self, num_new_tokens: int, fresh: list[int]) -> list[tuple[int, int]]:
        """`append` with the blocks already allocated: exactly `blocks_needed(num_new_tokens)` of them."""
        if len(fresh) != self.blocks_needed(num_new_tokens):
            raise ValueError(f"{len(fresh)} blocks given, {self.blocks_needed(num_new_tokens)} needed")
        copies: list[tuple[int, int]] = []
        needed = len(fresh)
        if num_new_tokens > 0 and self._last_block_is_shared():
            shared, copy = self.block_ids[-1], fresh.pop()
            copies.append((shared, copy))
            self.block_ids[-1] = copy
            self.pool.release([shared])
        self.block_ids.extend(fresh)
        if needed:  # a copy-on-write copy is counted in `needed` too
            self.version += 1
        self.num_tokens += num_new_tokens
        return copies

    def truncate(self, num_tokens: int) -> None:
        """Shrink to num_tokens (<= the current count): the blocks wholly beyond are given back (a
        rejected speculative draft's slots); slots past num_tokens in the kept last block are simply
        written again later."""
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot truncate {self.num_tokens} tokens to {num_tokens}")
        keep = self.pool.blocks_for(num_tokens)
        if keep < len(self.block_ids):
            self.pool.release(self.block_ids[max(keep, self.num_dropped):])
            self.num_dropped = min(self.num_dropped, keep)
            del self.block_ids[keep:]
            self.version += 1
        self.num_tokens = num_tokens

    def drop_out_of_window(self, computed_len: int) -> int:
        """Give back the blocks no query of the next step can see: the first one sits at position
        computed_len and sees keys from computed_len - window + 1 on. Returns how many."""
        return 0 if self.window is None else self.drop_before(computed_len - self.window + 1)

    def drop_before(self, num_tokens: int) -> int:
        """Give back the blocks wholly before token num_tokens (no query will see them again: they left
        a sliding window); returns how many were given back. Never the block being written."""
        upto = min(num_tokens, self.num_tokens - 1) // self.pool.block_size
        if upto <= self.num_dropped:
            return 0
        dropped = self.block_ids[self.num_dropped:upto]
        self.pool.release(dropped)
        self.block_ids[self.num_dropped:upto] = [NO_BLOCK] * len(dropped)
        self.num_dropped = upto
        self.version += 1
        return len(dropped)

    def fork(self) -> BlockTable:
        """A child sharing every held block (one more reference on each) and the dropped slots."""
        self.pool.retain(self.held_ids)
        return BlockTable(self.pool, self.block_ids, self.num_tokens, self.window)

    def release(self) -> None:
        """Give back every reference; the table is empty afterwards."""
        self.pool.release(self.held_ids)
        self.block_ids = []
        self.num_tokens = self.num_dropped = 0
        self.version += 1

    def _last_block_is_shared(self) -> bool:
        partial = self.num_tokens % self.pool.block_size != 0
        return partial and self.pool.ref_count(self.block_ids[-1]) > 1
