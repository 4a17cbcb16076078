"""Radix prefix tree: token ids -> KV block ids, one tree per cache namespace.

Edges hold whole blocks only: an edge's key has `len(blocks) * block_size` tokens, and children
are keyed by their first block of tokens, so every split falls on a block boundary. The
namespace is part of the key: a lookup in one namespace never sees another's entries (tenants
cannot probe each other's prompts through cache timing).

Ownership: the tree holds one pool reference on each cached block and gives it back only from
`evict` (it never frees on its own). `lock(handle)` gives the caller one reference on every block
from the root to the handle, which keeps that path from eviction; releasing those references
(`unlock`, or `pool.release` of the same ids) makes it evictable again. Because every holder
holds a root path, a referenced block's ancestors are referenced too, so unreferenced nodes are
always whole subtrees and eviction can go leaf first. (The one exception is brief: a sequence that
inserts blocks below a prefix it did not hold, until it releases them.)

Layer groups (cache/kv_layout.py): with several, a path is keyed by group 0's pages and each of
them carries its position's pages of the other groups (`companions`, NO_BLOCK where the inserting
sequence had given them back), cached, evicted and counted with it. A match stops where some
group's window before it is incomplete (cache/companions.py). Invariant: a sequence that holds a
companion holds its group-0 page too (group 0 has the widest window), so a group-0 page with only
the tree's reference has companions with only the tree's too, and they go together.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cache.block_pool import BlockPool
from cache.block_table import NO_BLOCK
from cache.companions import CompanionPages
from cache.radix_node import Node, descendants, path_blocks, path_to_root, root_of


@dataclass
class NamespaceStats:
    hit_tokens: int = 0  # prompt tokens served from the cache by match
    miss_tokens: int = 0  # prompt tokens match could not serve
    inserted_tokens: int = 0
    evicted_tokens: int = 0


@dataclass(frozen=True)
class MatchResult:
    cached_len: int  # tokens covered by block_ids; a multiple of block_size, <= len(tokens) - 1
    block_ids: list[int]
    handle: Node | None  # deepest matched node; pass to lock/unlock
    companions: list[tuple[int, ...]] = field(default_factory=list)  # per block: the other groups' pages


class RadixPrefixTree:
    def __init__(self, pool: BlockPool, companion_windows: Sequence[int | None] = ()) -> None:
        """`companion_windows`: the windows of groups 1.. of a layout with several (none: one group)."""
        self.pool = pool
        self.block_size = pool.block_size
        self.companions = CompanionPages(pool, companion_windows)  # the other groups' pages (layer groups)
        self._roots: dict[str, Node] = {}
        self.stats: dict[str, NamespaceStats] = {}
        self._clock = itertools.count(1)
        # Candidate leaves for eviction as (last_access, tiebreak, node); entries go stale when a
        # node is touched, split off, gets children or dies, and are skipped when popped.
        self._leaf_heap: list[tuple[int, int, Node]] = []
        self._tiebreak = itertools.count()
        self._num_nodes = 0
        pool.set_evictor(self.evict)

    # -- lookups ------------------------------------------------------------------------------
    def match(self, namespace: str, tokens: Sequence[int], count: bool = True) -> MatchResult:
        """Longest cached prefix of whole blocks, never covering the last token. `count`: add it to
        the namespace's hit/miss stats now (otherwise the caller does, with `count_match`)."""
        tokens = list(tokens)
        node, num_blocks, block_ids = self._walk(namespace, tokens, self._usable(namespace, tokens))
        if node is not None:
            self._touch(node)
        cached_len = num_blocks * self.block_size
        if count:
            self.count_match(namespace, len(tokens), cached_len)
        return MatchResult(cached_len, block_ids, node, self.companions.of(block_ids))

    def _usable(self, namespace: str, tokens: list[int]) -> int:
        """Whole blocks a match may serve: never the last token, and (layer groups) only as far as
        every group still holds the keys the next query sees."""
        max_blocks = (len(tokens) - 1) // self.block_size
        if not self.companions:
            return max_blocks
        _, _, block_ids = self._walk(namespace, tokens, max_blocks, split=False)
        return self.companions.usable(block_ids)

    def count_match(self, namespace: str, num_tokens: int, cached_len: int) -> None:
        """Count a match of num_tokens tokens whose first cached_len were cached (hit/miss stats)."""
        stats = self.stats.setdefault(namespace, NamespaceStats())
        stats.hit_tokens += cached_len
        stats.miss_tokens += num_tokens - cached_len

    def match_partial_block(self, namespace: str, tokens: Sequence[int], match: MatchResult) -> tuple[int, int] | None:
        """After `match`, a cached block whose first k tokens (0 < k < block_size) continue the
        prompt: (block id, k), the longest such k, never covering the last token. The caller copies
        that block's K/V into a block of its own (the tree's block stays as it is) and computes
        from position cached_len + k. (Not counted in the namespace's hit stats, which count whole
        blocks.)"""
        node = match.handle or self._roots.get(namespace)
        if node is None:
            return None
        start = match.cached_len
        wanted = list(tokens[start : min(start + self.block_size, len(tokens) - 1)])
        best: tuple[int, int] | None = None
        for key, child in node.children.items():
            k = 0
            while k < len(wanted) and key[k] == wanted[k]:
                k += 1
            if k and (best is None or k > best[1]):
                best = (child.blocks[0], k)
        return best

    def peek(self, namespace: str, tokens: Sequence[int]) -> int:
        """Tokens `match` would serve now, without counting it in the stats or touching LRU order."""
        tokens = list(tokens)
        _, num_blocks, _ = self._walk(namespace, tokens, self._usable(namespace, tokens), split=False)
        return num_blocks * self.block_size

    def insert(self, namespace: str, tokens: Sequence[int], block_ids: Sequence[int],
               companions: Sequence[tuple[int, ...]] = ()) -> int:
        """Cache the whole blocks of `tokens` (held by the caller as `block_ids`; with layer groups,
        `companions[i]` are block i's pages of the other groups, NO_BLOCK where given back).

        Returns how many tokens were already cached; the caller's blocks for that part are
        duplicates it simply releases. The tree takes its own reference on the blocks it adds. The
        path stops before the first NO_BLOCK past what is cached (a block given back: nothing after
        it can hang below it).
        """
        tokens = list(tokens)
        num_blocks = len(tokens) // self.block_size
        if len(block_ids) < num_blocks:
            raise ValueError(f"{num_blocks} full blocks of tokens but only {len(block_ids)} block ids")
        if namespace not in self._roots:
            self._roots[namespace] = Node(key=[], blocks=[], parent=None, namespace=namespace)
        node, matched, _ = self._walk(namespace, tokens, num_blocks)
        node = node or self._roots[namespace]
        new_blocks = list(block_ids[matched:num_blocks])
        if NO_BLOCK in new_blocks:  # a path goes only as far as its owner still holds it (sliding window)
            new_blocks = new_blocks[: new_blocks.index(NO_BLOCK)]
            num_blocks = matched + len(new_blocks)
        if matched < num_blocks:
            bs = self.block_size
            child = Node(key=list(tokens[matched * bs : num_blocks * bs]), blocks=new_blocks, parent=node)
            node.children[tuple(child.key[:bs])] = child
            self.pool.cache(new_blocks)
            for i, block in enumerate(new_blocks, start=matched):
                if self.companions:
                    self.companions.add(block, tuple(companions[i]))
            self._num_nodes += 1
            self.stats.setdefault(namespace, NamespaceStats()).inserted_tokens += len(child.key)
            node = child
        if node.parent is not None:
            self._touch(node)
        return matched * self.block_size

    def _walk(self, namespace: str, tokens: list[int], max_blocks: int,
              split: bool = True) -> tuple[Node | None, int, list[int]]:
        """Follow `tokens` down whole blocks (at most max_blocks), splitting the last edge where
        the match ends inside it (unless `split` is False: then the node returned may go on past
        the match). Returns (deepest matched node or None, blocks matched, ids)."""
        root = self._roots.get(namespace)
        if root is None:
            return None, 0, []
        bs = self.block_size
        node, pos, block_ids = root, 0, []
        while pos < max_blocks:
            child = node.children.get(tuple(tokens[pos * bs : (pos + 1) * bs]))
            if child is None:
                break
            edge_blocks = len(child.blocks)
            limit = min(edge_blocks, max_blocks - pos)
            if limit == edge_blocks and child.key == tokens[pos * bs : (pos + edge_blocks) * bs]:
                matched = edge_blocks
            else:
                matched = 1
                while matched < limit and (
                    child.key[matched * bs : (matched + 1) * bs] == tokens[(pos + matched) * bs : (pos + matched + 1) * bs]
                ):
                    matched += 1
            if matched < edge_blocks and split:
                child = self._split(child, matched)
            block_ids.extend(child.blocks[:matched])
            pos += matched
            node = child
            if matched < edge_blocks:
                break
        return (node if pos else None), pos, block_ids

    def _split(self, node: Node, num_blocks: int) -> Node:
        """Cut `node`'s edge after num_blocks; returns the new upper node (node keeps the rest)."""
        bs = self.block_size
        parent = node.parent
        assert parent is not None
        upper = Node(
            key=node.key[: num_blocks * bs], blocks=node.blocks[:num_blocks], parent=parent,
            last_access=node.last_access,
        )
        node.key, node.blocks = node.key[num_blocks * bs :], node.blocks[num_blocks:]
        node.parent = upper
        upper.children[tuple(node.key[:bs])] = node
        parent.children[tuple(upper.key[:bs])] = upper
        self._num_nodes += 1
        return upper

    def _touch(self, node: Node) -> None:
        """Mark the path root..node as used now; (re)queue node if it is a leaf."""
        now = next(self._clock)
        bottom = node
        while node.parent is not None:
            node.last_access = now
            node = node.parent
        if not bottom.children:
            self._push_leaf(bottom)

    def _push_leaf(self, node: Node) -> None:
        heapq.heappush(self._leaf_heap, (node.last_access, next(self._tiebreak), node))
        if len(self._leaf_heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        leaves = [n for root in self._roots.values() for n in descendants(root) if not n.children]
        self._leaf_heap = [(n.last_access, next(self._tiebreak), n) for n in leaves]
        heapq.heapify(self._leaf_heap)

    # -- locking ------------------------------------------------------------------------------
    def lock(self, handle: Node | None) -> None:
        """Give the caller one reference on each block from the root to `handle`."""
        self.pool.retain(path_blocks(handle))

    def unlock(self, handle: Node | None) -> None:
        self.pool.release(path_blocks(handle))

    # -- eviction -----------------------------------------------------------------------------
    def evict(self, num_blocks: int) -> list[int]:
        """Free about num_blocks unreferenced blocks, least recently used leaves first, taking
        blocks from the end of a leaf's edge; a parent becomes a leaf once its children are gone.
        With layer groups, first the companions no sequence holds below a group-0 page a sequence
        does hold: what a running sequence gave back as it left its window."""
        freed = self.companions.evict_left(num_blocks) if self.companions else []
        referenced: list[Node] = []  # leaves in use now; requeued afterwards
        while len(freed) < num_blocks and self._leaf_heap:
            access, _, node = heapq.heappop(self._leaf_heap)
            if not node.alive or node.children or node.last_access != access:
                continue
            if self.pool.ref_count(node.blocks[-1]) != 1:
                referenced.append(node)
                continue
            self._evict_tail(node, num_blocks, freed)
            if node.alive:
                referenced.append(node)  # partly evicted and still a leaf: keep it queued
        for node in referenced:
            self._push_leaf(node)
        return freed

    def _evict_tail(self, node: Node, num_blocks: int, freed: list[int]) -> None:
        """Evict the leaf's unreferenced tail until `freed` holds num_blocks pages (a group-0 page
        goes with its companions: `freed` may end a few over)."""
        bs = self.block_size
        edge_key = tuple(node.key[:bs])
        taken = 0
        while node.blocks and len(freed) < num_blocks and self.pool.ref_count(node.blocks[-1]) == 1:
            block_id = node.blocks.pop()
            del node.key[-bs:]
            pages = [block_id, *self.companions.pop(block_id)]
            self.pool.uncache(pages)
            freed.extend(pages)
            taken += 1
        self.stats[root_of(node).namespace].evicted_tokens += taken * bs
        if node.blocks:
            return
        parent = node.parent
        assert parent is not None
        del parent.children[edge_key]
        node.alive = False
        self._num_nodes -= 1
        if not parent.children and parent.parent is not None:
            self._push_leaf(parent)

    # -- checks -------------------------------------------------------------------------------
    def cached_prefixes(self, namespace: str) -> list[list[int]]:
        """Token sequences of every leaf path (for tests and debugging)."""
        root = self._roots.get(namespace)
        if root is None:
            return []
        out = []
        for node in descendants(root):
            if not node.children:
                out.append([t for n in reversed(list(path_to_root(node))) for t in n.key])
        return out

    def check_integrity(self, holders: Mapping[int, int] | None = None) -> None:
        """Raise AssertionError unless tree and pool agree (see BlockPool.check_integrity)."""
        self.pool.check_integrity(holders)
        bs = self.block_size
        seen: set[int] = set()
        num_nodes = 0
        for root in self._roots.values():
            for node in descendants(root):
                num_nodes += 1
                if len(node.key) != len(node.blocks) * bs or not node.blocks:
                    raise AssertionError("an edge is not a whole number of blocks")
                if node.parent is None or node.parent.children.get(tuple(node.key[:bs])) is not node:
                    raise AssertionError("a child is not keyed by its first block")
                pages = [p for b in node.blocks for p in (b, *self.companions.held(b))]
                for block_id in pages:
                    if block_id in seen or not self.pool.is_cached(block_id):
                        raise AssertionError(f"block {block_id} is in the tree twice or not marked cached")
                    seen.add(block_id)
        if num_nodes != self._num_nodes:
            raise AssertionError(f"node count {self._num_nodes} != actual {num_nodes}")
        cached = sum(self.pool.is_cached(b) for b in range(self.pool.num_blocks))
        if cached != len(seen):
            raise AssertionError(f"{cached} blocks marked cached, {len(seen)} in the tree")

