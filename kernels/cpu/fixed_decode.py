"""Decode attention over fixed-shape block tables, for the compiled decode step
(workers/engine/compiled_decode.py, backend `cpu`): pure tensor ops with no Python value of the batch
read, no host sync and no per-step plan, so `torch.compile` traces it whole for a batch bucket.

The tables are [B, W] (W blocks: the step's context bucket; rows padded with a valid block), every
row attends over all W * block_size gathered keys with an additive mask hiding positions at or past
its context length (or outside its window). The eager CPU path (attention.py) gathers only up to the
longest context and plans a shared prefix (cascade.py) in Python; this one trades that for a graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu.common import visibility_mask


def store_and_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Write k/v [B, Hkv, D] at their slots, then q [B, Hq, D] (one token per sequence) attends over
    its sequence's blocks -> [B, Hq, D]."""
    # index_put_ (not index_copy_ as the eager path): inductor re-inplaces it into the cache, which is
    # otherwise copied whole to apply the functionalised write.
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    blocks = block_tables.long()
    num_keys = blocks.shape[1] * k_cache.shape[1]
    keys = k_cache[blocks].view(batch, num_keys, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[blocks].view(batch, num_keys, num_kv_heads, head_dim).transpose(1, 2)
    lengths = context_lens.long()[:, None]
    key_positions = torch.arange(num_keys, device=q.device)[None, :]
    mask = visibility_mask(key_positions, lengths - 1, lengths, sliding_window, q.dtype)[:, None, None, :]
    grouped = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)
