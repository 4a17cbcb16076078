"""Random interleavings of cache operations, checked after every step against a plain model."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from cache import BlockPool, BlockTable, OutOfBlocksError, RadixPrefixTree
from cache.block_table import NO_BLOCK

BLOCK_SIZE = 2
NAMESPACES = st.sampled_from(["tenant-a", "tenant-b", "shared"])
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=11)  # tiny alphabet: many shared prefixes


class Sequence:
    def __init__(self, namespace: str, tokens: list[int], table: BlockTable) -> None:
        self.namespace, self.tokens, self.table = namespace, tokens, table


class CacheMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=24, block_size=BLOCK_SIZE)
        self.tree = RadixPrefixTree(self.pool)
        self.live: list[Sequence] = []
        # reference model: the block-aligned prefixes each namespace has cached
        self.cached: dict[str, set[tuple[int, ...]]] = {}

    def expected_cached_len(self, namespace: str, tokens: list[int]) -> int:
        best = 0
        for k in range(1, (len(tokens) - 1) // BLOCK_SIZE + 1):
            if tuple(tokens[: k * BLOCK_SIZE]) in self.cached.get(namespace, set()):
                best = k * BLOCK_SIZE
        return best

    def tree_prefixes(self, namespace: str) -> set[tuple[int, ...]]:
        out = set()
        for path in self.tree.cached_prefixes(namespace):
            out.update(tuple(path[: k * BLOCK_SIZE]) for k in range(1, len(path) // BLOCK_SIZE + 1))
        return out

    def total_evicted_blocks(self) -> int:
        return sum(s.evicted_tokens for s in self.tree.stats.values()) // BLOCK_SIZE

    def sync_evictions(self, evicted_before: int) -> int:
        """Drop evicted prefixes from the model (allocation evicts on demand); returns how many.
        Only whole prefixes the tree really dropped may disappear, one per evicted block."""
        removed = 0
        for namespace, known in self.cached.items():
            now = self.tree_prefixes(namespace)
            assert now <= known
            removed += len(known - now)
            self.cached[namespace] = now
        assert removed == self.total_evicted_blocks() - evicted_before
        return removed

    @rule(target=sequences, namespace=NAMESPACES, tokens=TOKENS)
    def start(self, namespace: str, tokens: list[int]):
        match = self.tree.match(namespace, tokens)
        assert match.cached_len == self.expected_cached_len(namespace, tokens)
        assert match.cached_len <= len(tokens) - 1
        self.tree.lock(match.handle)
        table = BlockTable(self.pool, match.block_ids, match.cached_len)
        evicted_before = self.total_evicted_blocks()
        try:
            table.append(len(tokens) - match.cached_len)
        except OutOfBlocksError:
            table.release()
            return None
        finally:
            self.sync_evictions(evicted_before)
        seq = Sequence(namespace, list(tokens), table)
        self.live.append(seq)
        return seq

    @rule(seq=sequences, extra=TOKENS)
    def extend(self, seq: Sequence | None, extra: list[int]) -> None:
        if seq is None or seq not in self.live:
            return
        before = list(seq.table.block_ids)
        evicted_before = self.total_evicted_blocks()
        try:
            copies = seq.table.append(len(extra))
        except OutOfBlocksError:
            assert seq.table.block_ids == before  # unchanged on failure
            return
        finally:
            self.sync_evictions(evicted_before)
        for src, dst in copies:
            assert src == before[-1] and dst == seq.table.block_ids[len(before) - 1]
        seq.tokens += extra

    @rule(target=sequences, seq=sequences)
    def fork(self, seq: Sequence | None):
        if seq is None or seq not in self.live:
            return None
        child = Sequence(seq.namespace, list(seq.tokens), seq.table.fork())
        self.live.append(child)
        return child

    @rule(seq=sequences, keep=st.integers(0, 11))
    def slide(self, seq: Sequence | None, keep: int) -> None:
        """A sliding window moves on: the blocks wholly before the last `keep` tokens are given back."""
        if seq is None or seq not in self.live:
            return
        table = seq.table
        before, held_before = list(table.block_ids), len(table.held_ids)
        gone = table.drop_before(len(seq.tokens) - keep)
        after = table.block_ids
        assert len(after) == len(before) and after[table.num_dropped:] == before[table.num_dropped:]
        assert after[: table.num_dropped] == [NO_BLOCK] * table.num_dropped
        assert gone == held_before - len(table.held_ids)
        assert table.num_dropped <= (len(seq.tokens) - 1) // BLOCK_SIZE  # never the block being written
        assert all(b != NO_BLOCK and self.pool.ref_count(b) > 0 for b in table.held_ids)

    @rule(seq=consumes(sequences))
    def finish(self, seq: Sequence | None) -> None:
        if seq is None or seq not in self.live:
            return
        already = self.tree.insert(seq.namespace, seq.tokens, seq.table.block_ids)
        known = self.cached.setdefault(seq.namespace, set())
        full = len(seq.tokens) // BLOCK_SIZE
        assert already == max(k * BLOCK_SIZE for k in range(full + 1) if tuple(seq.tokens[: k * BLOCK_SIZE]) in known or k == 0)
        if already // BLOCK_SIZE < seq.table.num_dropped:  # the path breaks at a block given back
            full = already // BLOCK_SIZE
        known.update(tuple(seq.tokens[: k * BLOCK_SIZE]) for k in range(1, full + 1))
        seq.table.release()
        self.live.remove(seq)

    @rule(seq=consumes(sequences))
    def abort(self, seq: Sequence | None) -> None:
        if seq is None or seq not in self.live:
            return
        seq.table.release()
        self.live.remove(seq)

    @rule(num_blocks=st.integers(1, 30))
    def evict(self, num_blocks: int) -> None:
        evictable = self.pool.num_evictable
        evicted_before = self.total_evicted_blocks()
        freed = self.tree.evict(num_blocks)
        assert len(freed) <= num_blocks
        assert len(set(freed)) == len(freed) and all(self.pool.ref_count(b) == 0 for b in freed)
        if not self.live:  # nothing holds a block: every cached block can go
            assert len(freed) == min(num_blocks, evictable)
        assert self.sync_evictions(evicted_before) == len(freed)

    @rule(namespace=NAMESPACES, tokens=TOKENS)
    def probe(self, namespace: str, tokens: list[int]) -> None:
        assert self.tree.match(namespace, tokens).cached_len == self.expected_cached_len(namespace, tokens)

    @invariant()
    def integrity(self) -> None:
        holders = Counter(b for seq in self.live for b in seq.table.held_ids)
        self.tree.check_integrity(holders)
        for namespace, known in self.cached.items():
            assert self.tree_prefixes(namespace) == known
        assert self.pool.num_free + self.pool.num_evictable + self.pool.num_used == self.pool.num_blocks


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
