"""One decode step as a pure function of fixed-shape tensors, for `torch.compile`
(workers/engine/compiled_decode.py): every sequence decodes one token; its position, K/V slot, block
table row (padded to the step's context bucket) and context length come in as tensors, and no Python
value of the batch is read, so dynamo traces the whole step, LM head included, into one graph per
batch bucket.

Two bodies, by attention backend:
- `native`: the fused native step (fused_decode.decode_layers: the C++ ops are opaque externs to
  inductor, which still fuses the glue around them and drops the per-op Python/dispatcher cost);
- `cpu`: the eager layers (`DecoderLayer.forward_with`, same ops and roundings) with attention over
  the gathered blocks (kernels/cpu/fixed_decode.py), which inductor may fuse with its neighbours.
Both give the eager step's logits (fp32: equal up to summation order; see the tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cache.kv_storage import KVStorage
from kernels.cpu.fixed_decode import store_and_attend
from workers.models import fused_decode

if TYPE_CHECKING:
    from workers.models.llama import DecoderLayer, LlamaForCausalLM


def decode_logits(
    model: LlamaForCausalLM, kv: KVStorage, native: bool, input_ids: torch.Tensor, positions: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
) -> torch.Tensor:
    """fp32 logits [B, V] of a decode step (input_ids, positions, slot_mapping, context_lens [B];
    block_tables [B, W] int32); writes each token's K/V. The rotary tables must already reach every
    position (`RotaryTable.reserve`)."""
    cos, sin = model.rotary.lookup(positions, model.dtype)  # [B, D]
    if native:
        hidden = fused_decode.decode_layers(model, input_ids, kv, slot_mapping, block_tables, context_lens, cos, sin)
    else:
        hidden = model.embed_tokens(input_ids).float()
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for module in model.layers:
            layer: DecoderLayer = module  # type: ignore[assignment]
            k_cache, v_cache = kv.keys[layer.layer_index], kv.values[layer.layer_index]

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: DecoderLayer = layer,
                       k_cache: torch.Tensor = k_cache, v_cache: torch.Tensor = v_cache) -> torch.Tensor:
                return store_and_attend(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                                        layer.scale, layer.sliding_window)

            hidden = layer.forward_with(hidden, cos, sin, attend)
    return model.logits(hidden)
