"""KV block pool, radix prefix tree, block tables and paged KV storage.

The tree logic (block_pool, radix_tree, block_table) is plain Python on ints; only kv_storage uses torch.
"""

from cache.block_pool import BlockPool, OutOfBlocksError
from cache.block_table import BlockTable
from cache.radix_tree import MatchResult, NamespaceStats, RadixPrefixTree

__all__ = ["BlockPool", "BlockTable", "MatchResult", "NamespaceStats", "OutOfBlocksError", "RadixPrefixTree"]
