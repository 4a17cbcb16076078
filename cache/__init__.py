"""The KV memory: block pool, radix prefix tree, block tables, paged KV storage, and the facade
that owns pool and tree together (`manager.KVCacheManager`, what the engine's scheduler calls).

The tree logic (block_pool, radix_tree, block_table, manager) is plain Python on ints; only
kv_storage uses torch. Nothing here imports `workers/` or `gateway/`.
"""

from cache.block_pool import BlockPool, OutOfBlocksError
from cache.block_table import BlockTable
from cache.manager import CacheStats, KVCacheManager, PrefixHit
from cache.radix_tree import MatchResult, NamespaceStats, RadixPrefixTree

__all__ = [
    "BlockPool",
    "BlockTable",
    "CacheStats",
    "KVCacheManager",
    "MatchResult",
    "NamespaceStats",
    "OutOfBlocksError",
    "PrefixHit",
    "RadixPrefixTree",
]
