"""Random interleavings of a grouped cache's verbs (one full group, two sliding ones of window 3 over
one page pool): pool, tree and tables agree after every step, and no page is ever served for
tokens or a group other than those it was filled for.

Each full page is tagged (group, the tokens up to its block's end) when its sequence fills it; a
hit must hand each group only pages tagged with its own group and the hitting prompt's tokens,
and must hold every page its windows need."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from cache import KVCacheManager, OutOfBlocksError
from cache.block_table import NO_BLOCK
from cache.companions import first_needed_block
from cache.grouped_table import GroupedBlockTable
from cache.kv_layout import KVLayout

BS, WINDOW = 2, 3
NAMESPACES = st.sampled_from(["tenant-a", "shared"])
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=11)  # tiny alphabet: many shared prefixes


class Sequence:
    def __init__(self, namespace: str, tokens: list[int], table: GroupedBlockTable) -> None:
        self.namespace, self.tokens, self.table = namespace, tokens, table


class GroupedCacheMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.cache = KVCacheManager(30, BS, KVLayout.for_windows([WINDOW, None, WINDOW]))
        self.live: list[Sequence] = []
        self.tags: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.finished: list[list[int]] = []  # token lists cached so far: prompts that come back hit them

    def tag_full_pages(self, seq: Sequence) -> None:
        """The sequence computed its tokens: its whole blocks' pages now hold them (a page it shares
        holds the same, or the check below fails)."""
        for group, table in enumerate(seq.table.groups):
            for j, page in enumerate(table.block_ids):
                if page != NO_BLOCK and (j + 1) * BS <= len(seq.tokens):
                    tag = (group, tuple(seq.tokens[: (j + 1) * BS]))
                    if self.cache.pool.ref_count(page) > 1 and page in self.tags:
                        assert self.tags[page] == tag, "a shared page holds other tokens"
                    self.tags[page] = tag

    @rule(target=sequences, pick=st.integers(0, 99), cut=st.integers(1, 16), extra=TOKENS)
    def come_back(self, pick: int, cut: int, extra: list[int]):
        """A prompt that goes on from part of a finished sequence's tokens (a chat's next turn)."""
        if not self.finished:
            return None
        return self.start("shared", self.finished[pick % len(self.finished)][:cut] + extra)

    @rule(target=sequences, namespace=NAMESPACES, tokens=TOKENS)
    def start(self, namespace: str, tokens: list[int]):
        hit = self.cache.match_and_lock(namespace, tokens)
        table = hit.table
        assert isinstance(table, GroupedBlockTable) and hit.cached_len <= len(tokens) - 1
        whole = hit.num_matched_blocks
        for group, (group_table, window) in enumerate(zip(table.groups, self.cache.windows, strict=True)):
            for j in range(first_needed_block(whole, window, BS), whole):
                page = group_table.block_ids[j]
                assert page != NO_BLOCK, "a hit lacks a page its window needs"
                assert self.tags[page] == (group, tuple(tokens[: (j + 1) * BS])), "a page served for other tokens"
        for src, _ in hit.copies:  # a partly matching block: its first tokens are the prompt's
            cached = self.tags[src][1]
            assert cached[: hit.cached_len] == tuple(tokens[: hit.cached_len])
        if self.cache.try_grow(table, len(tokens) - hit.cached_len) is None:
            self.cache.release(table)
            return None
        seq = Sequence(namespace, list(tokens), table)
        self.tag_full_pages(seq)
        self.live.append(seq)
        return seq

    @rule(seq=sequences, extra=TOKENS)
    def extend(self, seq: Sequence | None, extra: list[int]) -> None:
        if seq is None or seq not in self.live:
            return
        before = [list(t.block_ids) for t in seq.table.groups]
        try:
            seq.table.append(len(extra))
        except OutOfBlocksError:
            assert [t.block_ids for t in seq.table.groups] == before  # every group unchanged
            return
        seq.tokens += extra
        self.tag_full_pages(seq)

    @rule(seq=sequences)
    def slide_rule(self, seq: Sequence | None) -> None:
        self.slide(seq)

    def slide(self, seq: Sequence | None) -> None:
        if seq is None or seq not in self.live:
            return
        seq.table.drop_out_of_window(len(seq.tokens))
        full, *sliding = seq.table.groups
        assert full.num_dropped == 0
        for table in sliding:
            assert table.num_dropped <= max(0, len(seq.tokens) - WINDOW + 1) // BS

    @rule(target=sequences, seq=sequences)
    def fork(self, seq: Sequence | None):
        if seq is None or seq not in self.live:
            return None
        child = Sequence(seq.namespace, list(seq.tokens), seq.table.fork())
        self.live.append(child)
        return child

    @rule(seq=consumes(sequences), commit_first=st.booleans(), slide_first=st.booleans())
    def finish(self, seq: Sequence | None, commit_first: bool, slide_first: bool) -> None:
        if seq is None or seq not in self.live:
            return
        if commit_first:
            self.cache.commit(seq.namespace, seq.tokens, seq.table)
        if slide_first:
            self.slide(seq)
        self.cache.cache_and_release(seq.namespace, seq.tokens, seq.table)
        self.live.remove(seq)
        if seq.namespace == "shared":
            self.finished.append(seq.tokens)

    @rule(seq=consumes(sequences))
    def abort(self, seq: Sequence | None) -> None:
        if seq is None or seq not in self.live:
            return
        self.cache.release(seq.table)
        self.live.remove(seq)

    @rule(num_pages=st.integers(1, 30))
    def evict(self, num_pages: int) -> None:
        freed = self.cache.tree.evict(num_pages)
        assert len(set(freed)) == len(freed) and all(self.cache.pool.ref_count(p) == 0 for p in freed)
        for page in freed:
            self.tags.pop(page, None)

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity(seq.table for seq in self.live)
        pool = self.cache.pool
        assert pool.num_free + pool.num_evictable + pool.num_used == pool.num_blocks


TestGroupedCacheMachine = GroupedCacheMachine.TestCase
TestGroupedCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
