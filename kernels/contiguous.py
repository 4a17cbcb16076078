"""Contiguous-KV attention: the torch reference the model uses until paged KV lands.

Each sequence of a batch owns one row of a preallocated cache; a token at position p writes its
K/V at index p of its row and attends to indices <= p (and > p - window with a sliding window).
Rows may hold different lengths: padding written past a row's end is never read, because it is
overwritten by that row's next token before any query can see it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ContiguousKVCache:
    """K/V for a batch: keys[layer] and values[layer] are [batch, num_kv_heads, max_len, head_dim].

    The [heads, len, dim] inner layout is what `scaled_dot_product_attention` reads without a copy.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype
    ) -> ContiguousKVCache:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        return cls(
            keys=[torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
            values=[torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
        )

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about a step, built once per forward and reused by every layer."""

    positions: torch.Tensor  # [B, T] int64, absolute position of each new token
    batch_index: torch.Tensor  # [B, 1] int64, the cache row of each sequence
    kv_len: int  # cache prefix every query may need: max(positions) + 1
    fresh_causal: bool  # every row starts at 0: attend within the new tokens only, plain causal
    mask: torch.Tensor | None  # [B, 1, T, kv_len] bool (True = attend), None when none is needed


def build_metadata(positions: torch.Tensor, sliding_window: int | None = None) -> AttentionMetadata:
    batch, num_new = positions.shape
    kv_len = int(positions.max()) + 1
    starts_at_zero = bool((positions[:, 0] == 0).all()) and kv_len == num_new
    fits_window = sliding_window is None or num_new <= sliding_window
    fresh_causal = starts_at_zero and fits_window
    uniform_decode = num_new == 1 and bool((positions == kv_len - 1).all()) and (
        sliding_window is None or kv_len <= sliding_window
    )
    mask = None
    if not fresh_causal and not uniform_decode:
        key_positions = torch.arange(kv_len)
        query_positions = positions[:, :, None]
        mask = key_positions[None, None, :] <= query_positions
        if sliding_window is not None:
            mask &= key_positions[None, None, :] > query_positions - sliding_window
        mask = mask.unsqueeze(1)
    return AttentionMetadata(
        positions=positions,
        batch_index=torch.arange(batch).unsqueeze(1),
        kv_len=kv_len,
        fresh_causal=fresh_causal,
        mask=mask,
    )


def contiguous_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store k/v [B, T, Hkv, D] into the cache rows, then attend q [B, T, Hq, D]; returns [B, T, Hq, D]."""
    k_cache[meta.batch_index, :, meta.positions] = k
    v_cache[meta.batch_index, :, meta.positions] = v
    if meta.fresh_causal:
        keys, values = k.transpose(1, 2), v.transpose(1, 2)
    else:
        keys, values = k_cache[:, :, : meta.kv_len], v_cache[:, :, : meta.kv_len]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys,
        values,
        attn_mask=None if meta.fresh_causal else meta.mask,
        is_causal=meta.fresh_causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
