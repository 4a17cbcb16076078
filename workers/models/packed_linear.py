"""Linear layers whose weights are prepacked once for the CPU GEMM library (the decode step's
matmuls, issue 21): bf16 through oneDNN (`mkldnn._reorder_linear_weight` + `_linear_pointwise`,
only where oneDNN computes bf16 natively), fp32 through MKL's packed sgemm (`mkl._mkl_reorder_linear_weight`
+ `_mkl_linear`). Both give the same numbers as `F.linear` on the plain weight (measured: max
difference 0 at M = 32), so fp32 greedy parity with transformers is kept; the packed bf16 LM head
ran 4x faster than `F.linear` at M = 32 on the AVX512-BF16 host.

The plain weight stays the module's `weight` (shared with tied embeddings, read by the bf16 logits
refinement and by MKL's fallback when a batch's row count differs from the packing's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM

PACKED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def packing_kind(dtype: torch.dtype) -> str | None:
    """'mkldnn' (bf16), 'mkl' (fp32) or None when this torch/CPU has no packed GEMM for `dtype`."""
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "mkldnn"
    if dtype == torch.float32 and torch.backends.mkl.is_available():
        return "mkl"
    return None


class PackedLinear(nn.Module):
    """`linear` with its weight prepacked; forward(x [M, in]) -> [M, out] as `linear(x)`."""

    packed: torch.Tensor  # a buffer (not saved with the model)

    def __init__(self, linear: nn.Linear, kind: str, batch_hint: int) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.kind, self.batch_hint = kind, batch_hint
        with torch.no_grad():
            weight = linear.weight.detach()
            if kind == "mkldnn":
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
            else:
                packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, batch_hint)
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced by torch.compile: one opaque op (see packed_linear_op)
            return packed_linear_op(x, self.packed, self.weight, self.bias, self.kind, self.batch_hint)
        return _packed_linear(x, self.packed, self.weight, self.bias, self.kind, self.batch_hint)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   kind: str, batch_hint: int) -> torch.Tensor:
    if kind == "mkldnn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    # MKL's packed sgemm serves batches of `batch_hint` rows; other sizes run on the plain weight.
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, batch_hint)


@torch.library.custom_op("tollway_packed::linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     kind: str, batch_hint: int) -> torch.Tensor:
    """The packed matmul as one op inductor calls as it is: its own lowerings of the MKL / oneDNN
    packed linears require frozen (constant) weights, which a compiled step with its weights as
    inputs does not have (workers/engine/compiled_decode.py)."""
    return _packed_linear(x, packed, weight, bias, kind, batch_hint)


@packed_linear_op.register_fake
def _packed_linear_fake(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        kind: str, batch_hint: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def pack_linears(model: LlamaForCausalLM, batch_hint: int = 32) -> bool:
    """Replace every decoder layer's projections and the LM head by packed ones (once: a packed
    model is left as it is; so are quantized projections, `QuantizedLinear`s, which bring their own
    packing; a quantized head's float head is packed). False when the CPU offers no packing for the
    model's dtype."""
    weight = model.lm_head.weight
    kind = packing_kind(weight.dtype)
    if kind is None or weight.device.type != "cpu":
        return False
    owners = [(layer, name) for layer in model.layers for name in PACKED_PROJECTIONS]
    # A quantized model's head (QuantizedHead) keeps its float head for prefill: that one is packed.
    head_owner = (model.lm_head, "float_head") if hasattr(model.lm_head, "float_head") else (model, "lm_head")
    for owner, name in [*owners, head_owner]:
        linear = getattr(owner, name, None)  # MoE layers have no dense gate_up/down projections
        if isinstance(linear, nn.Linear):
            setattr(owner, name, PackedLinear(linear, kind, batch_hint))
    return True
