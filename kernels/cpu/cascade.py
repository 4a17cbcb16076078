"""Cascade decode attention on the CPU: a prefix shared by a group of sequences is read once.

Sequences that hit the same cached prefix hold the very same block ids for it. Per step, decode
sequences are grouped by their first block; a group's shared part is the longest run of identical
leading blocks (whole blocks, always ending before each member's newest token). Attention then
runs in two parts: every member's queries attend the group's shared blocks in one call (gathered
once, not once per member), and each sequence attends its own remaining blocks; the two partial
results merge exactly by their log-sum-exps. Without shared blocks the plan is None and the
plain decode path runs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from kernels.cpu.common import GatherBuffers, per_sequence, visibility_mask
from kernels.kv_int8 import widen

_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass
class CascadePlan:
    """Groups are batched into one attention call: group g's shared keys are row g (padded to the
    longest group, masked), its members' query rows are slots g * max_members + i (padded)."""

    own_index: torch.Tensor  # [B * own_blocks] each sequence's blocks after its shared part (padded)
    own_mask: torch.Tensor | None  # [B, 1, 1, own_blocks * block_size] additive; None if all full
    shared_index: torch.Tensor  # [groups * shared_blocks] each group's shared blocks (padded)
    shared_mask: torch.Tensor | None  # [groups, 1, 1, shared_blocks * block_size]; None if all equal
    member_rows: torch.Tensor  # [groups * max_members] decode row of each query slot (padding: row 0)
    grouped_rows: torch.Tensor  # [R] decode rows that belong to a group
    slot_of_row: torch.Tensor  # [R] their query slot
    num_groups: int
    max_members: int
    own_buffers: GatherBuffers = field(default_factory=GatherBuffers)
    shared_buffers: GatherBuffers = field(default_factory=GatherBuffers)


def common_prefix(tables: list[list[int]]) -> int:
    n = min(len(t) for t in tables)
    for i in range(n):
        if any(t[i] != tables[0][i] for t in tables[1:]):
            return i
    return n


def padded(rows: list[list[int]], width: int) -> list[int]:
    """Rows padded to `width` by repeating their first entry (a real block; masks hide it), flattened."""
    return [x for row in rows for x in row + [row[0]] * (width - len(row))]


def length_mask(lengths: list[int], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """[len, 1, 1, width] additive mask hiding keys past each length; None when all fill the width."""
    if all(n == width for n in lengths):
        return None
    n = torch.tensor(lengths, device=device)[:, None]
    mask = visibility_mask(torch.arange(width, device=device)[None, :], n - 1, n, None, dtype)
    return mask[:, None, None, :]


def plan_cascade(
    tables: list[list[int]], lengths: list[int], block_size: int, dtype: torch.dtype, device: torch.device
) -> CascadePlan | None:
    by_first_block: dict[int, list[int]] = defaultdict(list)
    for row, (table, length) in enumerate(zip(tables, lengths, strict=True)):
        if length > block_size:
            by_first_block[table[0]].append(row)
    shared_blocks = [0] * len(tables)
    groups: list[tuple[list[int], list[int]]] = []  # (rows, shared block ids)
    for rows in by_first_block.values():
        if len(rows) < 2:
            continue
        # whole blocks shared by all, stopping before the block of each member's newest token
        n = min(common_prefix([tables[r] for r in rows]), *((lengths[r] - 1) // block_size for r in rows))
        if n == 0:
            continue
        for r in rows:
            shared_blocks[r] = n
        groups.append((rows, tables[rows[0]][:n]))
    if not groups:
        return None
    own = [table[s : -(-length // block_size)] for table, s, length in zip(tables, shared_blocks, lengths, strict=True)]
    own_width = max(len(o) for o in own)
    shared_width = max(len(blocks) for _, blocks in groups)
    max_members = max(len(rows) for rows, _ in groups)
    grouped_rows = [r for rows, _ in groups for r in rows]
    slots = [g * max_members + i for g, (rows, _) in enumerate(groups) for i in range(len(rows))]

    def as_index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return CascadePlan(
        own_index=as_index(padded(own, own_width)),
        own_mask=length_mask([length - s * block_size for length, s in zip(lengths, shared_blocks, strict=True)],
                             own_width * block_size, dtype, device),
        shared_index=as_index(padded([blocks for _, blocks in groups], shared_width)),
        shared_mask=length_mask([len(blocks) * block_size for _, blocks in groups], shared_width * block_size,
                                dtype, device),
        member_rows=as_index(padded([rows for rows, _ in groups], max_members)),
        grouped_rows=as_index(grouped_rows),
        slot_of_row=as_index(slots),
        num_groups=len(groups),
        max_members=max_members,
    )


def cascade_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: CascadePlan, scale: float
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]; the query heads of a KV head act as its query rows (GQA)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    groups, members = plan.num_groups, plan.max_members
    grouped = q.view(batch, num_kv_heads, group_size, head_dim)
    keys, values = plan.own_buffers.gather(k_cache, v_cache, plan.own_index)
    keys, values = widen(keys, q.dtype), widen(values, q.dtype)  # no copy unless the cache is narrower
    own_out, own_lse = _flash_with_lse(grouped, per_sequence(keys, batch), per_sequence(values, batch), 0.0,
                                       False, attn_mask=plan.own_mask, scale=scale)
    # every group's members attend its shared blocks: one call for all groups
    rows = grouped.index_select(0, plan.member_rows).view(groups, members, num_kv_heads, group_size, head_dim)
    rows = rows.transpose(1, 2).reshape(groups, num_kv_heads, members * group_size, head_dim)
    keys, values = plan.shared_buffers.gather(k_cache, v_cache, plan.shared_index)
    keys, values = widen(keys, q.dtype), widen(values, q.dtype)
    shared_out, shared_lse = _flash_with_lse(rows, per_sequence(keys, groups), per_sequence(values, groups), 0.0,
                                             False, attn_mask=plan.shared_mask, scale=scale)
    shared_out = shared_out.view(groups, num_kv_heads, members, group_size, head_dim).transpose(1, 2)
    shared_out = shared_out.reshape(groups * members, num_kv_heads, group_size, head_dim)
    shared_lse = shared_lse.view(groups, num_kv_heads, members, group_size).transpose(1, 2)
    shared_lse = shared_lse.reshape(groups * members, num_kv_heads, group_size)
    # merge the two partial softmaxes of the grouped rows by their log-sum-exps
    s_out, s_lse = shared_out.index_select(0, plan.slot_of_row).float(), shared_lse.index_select(0, plan.slot_of_row)
    o_out, o_lse = own_out.index_select(0, plan.grouped_rows).float(), own_lse.index_select(0, plan.grouped_rows)
    top = torch.maximum(o_lse, s_lse)
    o_w, s_w = torch.exp(o_lse - top)[..., None], torch.exp(s_lse - top)[..., None]
    merged = (o_out * o_w + s_out * s_w) / (o_w + s_w)
    out = own_out.index_copy(0, plan.grouped_rows, merged.to(own_out.dtype))
    return out.reshape(batch, num_q_heads, head_dim)
