"""A sequence's block table: the ordered blocks holding its KV, one pool reference per block.

Forking (parallel sampling, `n > 1`) shares every block with the child by reference. Full blocks
are never written again, so sharing them is free; a shared, partly filled last block is copied
before the first write to it (copy-on-write), and the copy is returned for the KV storage to do.

`version` counts the changes to `block_ids` (blocks added, a block replaced by its copy, all
released): a mirror of the table (the engine's persistent block-table rows) is current exactly
when it saw the same version.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache.block_pool import BlockPool


class BlockTable:
    def __init__(self, pool: BlockPool, block_ids: Sequence[int] = (), num_tokens: int = 0) -> None:
        """Adopt `block_ids` (the caller hands over one reference on each) covering num_tokens."""
        if pool.blocks_for(num_tokens) > len(block_ids):
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens")
        self.pool = pool
        self.block_ids = list(block_ids)
        self.num_tokens = num_tokens
        self.version = 0

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks `append(num_new_tokens)` would allocate (including a copy-on-write copy)."""
        new = self.pool.blocks_for(self.num_tokens + num_new_tokens) - len(self.block_ids)
        return max(new, 0) + (num_new_tokens > 0 and self._last_block_is_shared())

    def append(self, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for num_new_tokens more tokens; returns (src, dst) block copies to perform.

        Raises OutOfBlocksError with the table unchanged when the pool cannot supply the blocks.
        """
        copies: list[tuple[int, int]] = []
        needed = self.blocks_needed(num_new_tokens)
        fresh = self.pool.allocate(needed) if needed else []
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
            self.pool.release(self.block_ids[keep:])
            del self.block_ids[keep:]
            self.version += 1
        self.num_tokens = num_tokens

    def fork(self) -> BlockTable:
        """A child sharing every block (one more reference on each)."""
        self.pool.retain(self.block_ids)
        return BlockTable(self.pool, self.block_ids, self.num_tokens)

    def release(self) -> None:
        """Give back every reference; the table is empty afterwards."""
        self.pool.release(self.block_ids)
        self.block_ids = []
        self.num_tokens = 0
        self.version += 1

    def _last_block_is_shared(self) -> bool:
        partial = self.num_tokens % self.pool.block_size != 0
        return partial and self.pool.ref_count(self.block_ids[-1]) > 1
