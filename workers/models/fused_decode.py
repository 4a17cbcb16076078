"""The step of a Llama-family model on the native CPU ops (kernels/cpu/native): per layer four
matmuls and four fused ops, no gather, no intermediate the eager path would not also make.

Per layer, on a batch of B decode tokens (one per sequence), with the residual stream `residual`
[B, H] fp32 updated in place:

    qkv    = qkv_proj(normed)                        [B, (Hq + 2 Hkv) D]
    rotary_store(qkv, ...)                           q, k rotated in place; k, v written at their slots
    attn   = paged_decode(q view of qkv, caches)     [B, Hq, D], reading the caches in place
    normed = add_rms_norm(residual, o_proj(attn))    residual += o; post-attention norm
    normed = add_rms_norm(residual, down_proj(silu_mul(gate_up_proj(normed))))
             with the NEXT layer's input norm (the last layer's residual add stands alone)

An all-decode step runs these layers as one native call (`decode_layers` of the C++ library, from the plan
of workers/models/layer_plan.py: the same ops, bit-equal, without ~9 Python op calls per layer); the
Python loop `_layers` serves torch.compile's trace and steps the plan does not cover.

A step with prefill chunks or drafts (`step_hidden`) runs the same ops on all its tokens. Where every
extending sequence is short (`rows_attention_max_context`) each new token attends as a decode row over the
cache up to its own position, so the step is the decode step's (one native call where the plan covers it);
otherwise the extending sequences attend by `native.extend_step` over their rotated q, k, v views of qkv.

The roundings are those of `DecoderLayer.forward` (the same dtype casts at the same points), so the
tokens equal the eager path's (exactly in fp32 up to summation order; see tests).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cache.kv_storage import KVStorage
from kernels.cpu import native
from kernels.metadata import PagedAttentionMetadata
from workers.models.layer_plan import PROJECTIONS, linear_call, plan_for
from workers.precision import cpu_has_amx_bf16

if TYPE_CHECKING:
    from workers.models.llama import DecoderLayer, LlamaForCausalLM


def can_fuse(model: LlamaForCausalLM, meta: PagedAttentionMetadata, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether this step can run fused whole: every sequence decoding and `can_fuse_layers`."""
    return meta.num_decodes == meta.num_seqs and can_fuse_layers(model, meta, kv_dtype)


def can_fuse_layers(model: LlamaForCausalLM, meta: PagedAttentionMetadata, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether this step's layers can run on the native ops (`step_hidden`): a plain Llama-layer model
    (not a subclass with other layers), the native backend, a covered shape and cache
    dtype (None: the model's). Sequences that extend (prefill chunks, drafts) attend on the CPU extend path."""
    c = model.config
    return (model.fused_decode_ok and meta.backend == "native" and model.device.type == "cpu"
            and native.covers(c.head_dim, c.num_q_heads, c.num_kv_heads, model.dtype, kv_dtype) and native.load())


ROWS_ATTENTION_MAX_CONTEXT = 512
"""Extending sequences of at most this many tokens (prefix and chunk) attend as decode rows: each new token a
`paged_decode` row over the cache up to its own position. Measured on a 2-core AVX512-BF16 EPYC (one fresh
sequence, 9 query / 3 KV heads of 64): 0.79 / 1.73 / 2.99 / 6.72 ms at 256 / 380 / 512 / 768 tokens against
1.09 / 3.56 / 4.36 / 7.00 ms for torch's flash SDPA in bf16 (fp32 alike; 8.0 against 6.6 ms at 768)."""

BF16_TILES_MAX_CONTEXT = 2048
"""The same bound where a bf16 model's rows over a bf16 cache attend as tiles on AVX512-BF16's dot products
(kernels/cpu/native/paged_prefill_bf16.h: runs of a sequence's consecutive tokens). One fresh sequence, 9 query /
3 KV heads of 64, on a 2-core Zen 4 EPYC: 1.38 / 2.52 / 4.68 / 10.1 / 18.8 ms at 512 / 768 / 1,024 / 1,536 /
2,048 tokens against 4.27 / 6.83 / 12.1 / 23.9 / 40.3 ms for torch's flash SDPA (bf16, causal); longer not
measured (`ops/bench/paged_decode.py --against-sdpa`, ops/bench/RESULTS.md). On a CPU with AMX-BF16 only where the tiles
take their products on AMX too (paged_prefill_amx.h: head dims of whole 64s, TOLLWAY_PREFILL_PRODUCTS not `bf16`):
torch's flash SDPA multiplies its bf16 blocks on AMX tiles, and on a 2-core Emerald Rapids Xeon it took 0.53 / 0.40
/ 0.31 / 0.34 of the vdpbf16ps tiles' time at 380 / 768 / 1,024 / 2,048 tokens; with the AMX tiles the engine's
prefill of 600-, 1,000- and 1,500-token prompts ran 1.30x, 1.31x and 1.26x faster at this bound than at
ROWS_ATTENTION_MAX_CONTEXT (medians, a 2-core AMX Xeon, `ops/bench/prefill_bound.py`)."""


def rows_attention_max_context(model: LlamaForCausalLM, kv: KVStorage) -> int:
    """The longest extending sequence (prefix and chunk) whose tokens attend as decode rows in `step_hidden`:
    BF16_TILES_MAX_CONTEXT where its runs go as bf16 tiles (a bf16 model over a bf16 cache, head dims of
    whole 32s, no sliding window: the kernel's conditions, on a CPU with AVX512-BF16) and, on a CPU with AMX
    (whose SDPA beats the vdpbf16ps tiles), where the tiles run on AMX as well; else ROWS_ATTENTION_MAX_CONTEXT."""
    c = model.config
    bf16_tiles = (model.dtype == torch.bfloat16 and kv.keys[0].dtype == torch.bfloat16 and c.head_dim % 32 == 0
                  and c.sliding_window is None and native.tile_matmul_available())
    if bf16_tiles and cpu_has_amx_bf16():
        bf16_tiles = (c.head_dim % 64 == 0 and native.amx_rows_available()
                      and os.environ.get("TOLLWAY_PREFILL_PRODUCTS") != "bf16")
    return BF16_TILES_MAX_CONTEXT if bf16_tiles else ROWS_ATTENTION_MAX_CONTEXT


def decode_hidden(
    model: LlamaForCausalLM, input_ids: torch.Tensor, kv: KVStorage, meta: PagedAttentionMetadata,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:
    """The fp32 hidden states [B, H] after the last layer (before the final norm) of a decode step;
    writes each token's K/V. cos/sin: [B, 1, D] in the model dtype, as `RotaryTable.gather` gives."""
    return rows_hidden(model, input_ids, kv, meta.slot_mapping, meta.block_tables, meta.context_lens, cos, sin)


def rows_hidden(
    model: LlamaForCausalLM, input_ids: torch.Tensor, kv: KVStorage, slot_mapping: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:
    """`decode_hidden` for N tokens that each attend as a decode row: token i over block_tables[i] up to
    context_lens[i] (int32 [N, M] and [N]). Eagerly the layers run as one native call
    (workers/models/layer_plan.py) where every projection has a kind there, else (and under torch.compile)
    the Python loop of `decode_layers`."""
    plan = None if torch.compiler.is_compiling() else plan_for(model, input_ids.shape[0])
    if plan is None:
        return decode_layers(model, input_ids, kv, slot_mapping, block_tables, context_lens, cos.squeeze(1),
                             sin.squeeze(1))
    residual = model.embed_tokens(input_ids).float()  # [N, H], owned by this step
    plan.run(residual, kv, cos.squeeze(1), sin.squeeze(1), slot_mapping, block_tables, context_lens)
    return residual


def step_hidden(
    model: LlamaForCausalLM, input_ids: torch.Tensor, kv: KVStorage, meta: PagedAttentionMetadata,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:
    """`decode_hidden` for any step `can_fuse_layers` takes: the decodes (the first `meta.num_decodes`
    sequences, one token each) attend with `paged_decode`; the other sequences' tokens too, as decode rows
    up to their positions, where every extending sequence holds at most `rows_attention_max_context` tokens,
    else with `native.extend_step` on their rotated q, k and v; every other op is the fused decode's."""
    d = meta.num_decodes
    if d == meta.num_seqs:
        return decode_hidden(model, input_ids, kv, meta, cos, sin)
    if max(meta.context_lens_list[d:]) <= rows_attention_max_context(model, kv):
        # K/V are stored (rotary_store) before each layer attends, so a row reads its own chunk's earlier tokens
        token_tables = meta.block_tables.index_select(0, meta.seq_of_token())
        token_lens = (meta.positions + 1).to(torch.int32)
        return rows_hidden(model, input_ids, kv, meta.slot_mapping, token_tables, token_lens, cos, sin)
    c = model.config
    n = input_ids.shape[0]
    block_tables, context_lens = meta.block_tables[:d], meta.context_lens[:d]

    def attend(layer: DecoderLayer, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        q = qkv[:, : c.q_size].view(n, c.num_q_heads, c.head_dim)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].view(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)
        extended = native.extend_step(q[d:], k[d:], v[d:], k_cache, v_cache, meta, layer.scale, layer.sliding_window)
        if not d:
            return extended
        decoded = torch.ops.tollway_cpu.paged_decode(q[:d], k_cache, v_cache, block_tables, context_lens, layer.scale,
                                                     layer.sliding_window or 0)
        return torch.cat([decoded, extended])

    return _layers(model, input_ids, kv, meta.slot_mapping, cos.squeeze(1), sin.squeeze(1), attend)


def decode_layers(
    model: LlamaForCausalLM, input_ids: torch.Tensor, kv: KVStorage, slot_mapping: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:
    """`decode_hidden` on plain tensors (cos/sin [B, D]): no Python value of the batch is read, so
    torch.compile traces it whole (workers/engine/compiled_decode.py)."""
    c = model.config

    def attend(layer: DecoderLayer, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        q = qkv[:, : c.q_size].view(qkv.shape[0], c.num_q_heads, c.head_dim)
        return torch.ops.tollway_cpu.paged_decode(q, k_cache, v_cache, block_tables, context_lens, layer.scale,
                                                  layer.sliding_window or 0)

    return _layers(model, input_ids, kv, slot_mapping, cos, sin, attend)


Attend = Callable[["DecoderLayer", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""attend(layer, qkv [N, (Hq + 2 Hkv) D] rotated and stored, k_cache, v_cache) -> attention [N, Hq, D]."""


def _layers(
    model: LlamaForCausalLM, input_ids: torch.Tensor, kv: KVStorage, slot_mapping: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
) -> torch.Tensor:
    """The layers of the module docstring on N tokens, `attend` giving each layer's attention."""
    ops = torch.ops.tollway_cpu
    layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
    c = model.config
    n = input_ids.shape[0]
    residual = model.embed_tokens(input_ids).float()  # [N, H], owned by this step
    normed = ops.add_rms_norm(residual, None, layers[0].input_norm.weight, layers[0].input_norm.eps)
    for i, layer in enumerate(layers):
        k_cache, v_cache = kv.keys[layer.layer_index], kv.values[layer.layer_index]
        qkv_proj, o_proj, gate_up_proj, down_proj = (linear_call(getattr(layer, name), n) for name in PROJECTIONS)
        qkv = qkv_proj(normed)
        ops.rotary_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, c.num_q_heads, c.num_kv_heads)
        attn = attend(layer, qkv, k_cache, v_cache)
        normed = ops.add_rms_norm(residual, o_proj(attn.view(n, -1)), layer.post_attention_norm.weight,
                                  layer.post_attention_norm.eps)
        down = down_proj(ops.silu_mul(gate_up_proj(normed)))
        if i + 1 < len(layers):
            nxt = layers[i + 1].input_norm
            normed = ops.add_rms_norm(residual, down, nxt.weight, nxt.eps)
        else:
            residual += down.float()
    return residual
