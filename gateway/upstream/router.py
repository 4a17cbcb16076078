"""Cache-aware choice of an engine worker for a request (pure Python, no I/O).

Workers keep the KV of prompts they have served in their prefix cache, so a request should go
to the worker that most likely still holds its longest prefix, unless load is imbalanced. The
rule follows SGLang's router "cache_aware" policy:

- imbalanced (max_load - min_load > balance_abs_threshold AND max_load > balance_rel_threshold *
  min_load): the least loaded worker;
- otherwise the worker with the longest indexed prefix, when matched / prompt length >=
  cache_threshold; else the least loaded one.

Ties among least-loaded workers go to the one with the fewest indexed tokens (the most free cache,
as SGLang's "smallest tree"), then to name order, so the choice is deterministic. Whatever was
chosen, the prompt is then recorded for that worker.

`PrefixIndex` is approximate: it remembers what was *routed* to each worker, not what the worker
still caches, at the granularity of whole chunks of `chunk_size` tokens (a prompt's trailing
partial chunk is not indexed, so matched counts are multiples of `chunk_size`).

Neither class is thread-safe: the gateway calls them from its event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

# The routing defaults (GatewaySettings' TOLLWAY_ROUTER_* default to these): SGLang's
# `CacheAwareConfig` values, except the relative balance threshold, 1.5 where SGLang uses 1.1.
BALANCE_ABS_THRESHOLD = 32
BALANCE_REL_THRESHOLD = 1.5
CACHE_THRESHOLD = 0.5
DEFAULT_CHUNK_SIZE = 16
DEFAULT_MAX_TOKENS_PER_WORKER = 65_536


class NoWorkerError(RuntimeError):
    """No healthy worker to route to (`loads` was empty)."""


class _Node:
    """One chunk of tokens below its parent. `workers` = the workers this prefix was routed to."""

    __slots__ = ("children", "key", "namespace", "parent", "workers")

    def __init__(self, parent: _Node | None, key: tuple[int, ...], namespace: str = "") -> None:
        self.parent = parent
        self.key = key  # the chunk on the edge from the parent (empty on a namespace root)
        self.namespace = namespace  # set on roots only
        self.children: dict[tuple[int, ...], _Node] = {}
        self.workers: set[str] = set()


class PrefixIndex:
    """Which token-id prefixes were recently routed to which worker, per namespace.

    A trie over fixed-size chunks of token ids, one root per namespace (namespaces never share
    nodes, so one tenant's prompts can never attract or reveal another's).

    Invariants:
    - prefix closure: a worker in a node's `workers` is in every ancestor's `workers` too, and a
      node with no workers has no children (it is removed from the trie);
    - per worker, `_lru[worker]` holds exactly the nodes naming it, least recently routed first.
      A routed path is touched deepest node first, so every node comes *before* its ancestors:
      the front is always a leaf for that worker, and evicting from the front keeps closure;
    - memory: after every `insert`, each worker names at most
      `max_tokens_per_worker // chunk_size` nodes (LRU leaves go first).
    """

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 max_tokens_per_worker: int = DEFAULT_MAX_TOKENS_PER_WORKER) -> None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be at least 1")
        if max_tokens_per_worker < chunk_size:
            raise ValueError("max_tokens_per_worker must be at least chunk_size")
        self.chunk_size = chunk_size
        self.max_tokens_per_worker = max_tokens_per_worker
        self._max_nodes = max_tokens_per_worker // chunk_size
        self._roots: dict[str, _Node] = {}
        # Values unused: an OrderedDict is the O(1) LRU list (move_to_end / popitem(last=False)).
        self._lru: dict[str, OrderedDict[_Node, None]] = {}

    def _chunks(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        ids = tuple(token_ids)
        c = self.chunk_size
        return [ids[i:i + c] for i in range(0, len(ids) - c + 1, c)]

    def insert(self, namespace: str, worker: str, token_ids: Sequence[int]) -> None:
        """Record that `token_ids` was routed to `worker`; may evict that worker's LRU leaves."""
        self._insert_chunks(namespace, worker, self._chunks(token_ids))

    def match(self, namespace: str, token_ids: Sequence[int]) -> dict[str, int]:
        """Worker -> number of leading tokens of `token_ids` routed to it (absent = 0)."""
        return self._match_chunks(namespace, self._chunks(token_ids))

    def _insert_chunks(self, namespace: str, worker: str, chunks: list[tuple[int, ...]]) -> None:
        if not chunks:
            return
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = _Node(None, (), namespace)
        path: list[_Node] = []
        for chunk in chunks:
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = _Node(node, chunk)
            child.workers.add(worker)
            path.append(child)
            node = child
        lru = self._lru.setdefault(worker, OrderedDict())
        for node in reversed(path):  # deepest first, so ancestors stay more recent (see invariants)
            lru[node] = None
            lru.move_to_end(node)
        while len(lru) > self._max_nodes:
            self._drop(worker, lru.popitem(last=False)[0])

    def _match_chunks(self, namespace: str, chunks: list[tuple[int, ...]]) -> dict[str, int]:
        node = self._roots.get(namespace)
        if node is None:
            return {}
        path: list[_Node] = []
        for chunk in chunks:
            node = node.children.get(chunk)
            if node is None:
                break
            path.append(node)
        # Walk back up: by closure a node's workers include its child's, so only a node naming
        # more workers than seen so far adds any (the common case is a length comparison).
        result: dict[str, int] = {}
        for depth in range(len(path), 0, -1):
            workers = path[depth - 1].workers
            if len(workers) > len(result):
                for worker in workers:
                    result.setdefault(worker, depth * self.chunk_size)
        return result

    def remove_worker(self, worker: str) -> None:
        """Forget everything routed to `worker` (it died or left)."""
        lru = self._lru.pop(worker, None)
        if lru is None:
            return
        for node in lru:  # leaves before their ancestors, so pruning goes bottom-up
            self._drop(worker, node)

    def tokens(self, worker: str) -> int:
        """Tokens currently indexed for `worker` (its share of the memory bound)."""
        lru = self._lru.get(worker)
        return len(lru) * self.chunk_size if lru else 0

    def workers(self) -> list[str]:
        return sorted(self._lru)

    def _drop(self, worker: str, node: _Node) -> None:
        node.workers.discard(worker)
        # Closure: a node nobody names has no named children left, so it and its root path
        # up to the first still-named node can go.
        while not node.workers and not node.children and node.parent is not None:
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            node = parent
        if node.parent is None and not node.children:  # an emptied namespace root
            self._roots.pop(node.namespace, None)

    def check_integrity(self) -> None:
        """AssertionError when an invariant above does not hold (tests)."""
        seen: dict[str, int] = {}
        stack: list[tuple[_Node, _Node | None]] = [(root, None) for root in self._roots.values()]
        while stack:
            node, parent = stack.pop()
            if parent is not None:
                if not node.workers:
                    raise AssertionError("a node naming no worker was left in the trie")
                if parent.parent is not None and not node.workers <= parent.workers:
                    raise AssertionError("prefix closure broken: a child names a worker its parent lacks")
                for worker in node.workers:
                    seen[worker] = seen.get(worker, 0) + 1
                    if node not in self._lru.get(worker, {}):
                        raise AssertionError(f"node names {worker!r} but is not in its LRU")
            stack.extend((child, node) for child in node.children.values())
        for worker, lru in self._lru.items():
            if len(lru) != seen.get(worker, 0):
                raise AssertionError(f"LRU of {worker!r} holds {len(lru)} nodes, trie names it {seen.get(worker, 0)}")
            if len(lru) > self._max_nodes:
                raise AssertionError(f"{worker!r} exceeds its memory bound")
        if any(not root.children for root in self._roots.values()):
            raise AssertionError("an empty namespace root was kept")


class Router:
    """Chooses a worker per request: cache affinity while load is balanced, least loaded otherwise."""

    def __init__(self, balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD, cache_threshold: float = CACHE_THRESHOLD,
                 index: PrefixIndex | None = None) -> None:
        if balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if not balance_rel_threshold >= 1.0:  # also rejects NaN
            raise ValueError("balance_rel_threshold must be >= 1")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self.index = index if index is not None else PrefixIndex()

    def choose(self, namespace: str, token_ids: Sequence[int], loads: Mapping[str, int]) -> str:
        """The worker for this request, among `loads` (healthy worker -> in-flight requests).

        Records the prompt for the chosen worker. Raises NoWorkerError when `loads` is empty.
        """
        if not loads:
            raise NoWorkerError("no healthy engine worker is available")
        index = self.index
        chunks = index._chunks(token_ids)
        chosen: str | None = None
        if chunks and not self.is_imbalanced(loads):
            matches = index._match_chunks(namespace, chunks)
            candidates = [w for w in matches if w in loads]  # unhealthy workers never win
            if candidates:
                best = min(candidates, key=lambda w: (-matches[w], loads[w], w))
                if matches[best] / len(token_ids) >= self.cache_threshold:
                    chosen = best
        if chosen is None:  # least loaded; then the most free index (SGLang: smallest tree); then name
            chosen = min(loads, key=lambda w: (loads[w], index.tokens(w), w))
        index._insert_chunks(namespace, chosen, chunks)
        return chosen

    def is_imbalanced(self, loads: Mapping[str, int]) -> bool:
        """Both SGLang conditions: an absolute gap above the threshold and a relative one."""
        low, high = min(loads.values()), max(loads.values())
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def forget_worker(self, worker: str) -> None:
        """Drop a dead or removed worker's index entries."""
        self.index.remove_worker(worker)

