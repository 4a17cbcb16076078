"""The one attention entry point the model calls.

For now it forwards to the contiguous-KV torch reference; the paged kernels (Triton on CUDA, a
torch CPU path otherwise) plug in here without the model changing.
"""

from __future__ import annotations

from kernels.contiguous import AttentionMetadata, ContiguousKVCache, build_metadata, contiguous_attention

attention = contiguous_attention

__all__ = ["AttentionMetadata", "ContiguousKVCache", "attention", "build_metadata"]
