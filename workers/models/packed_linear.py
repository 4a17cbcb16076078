"""The native decode step's linear layers (issue 21): bf16 weights prepacked for oneDNN
(`mkldnn._reorder_linear_weight` + `_linear_pointwise`, only where oneDNN computes bf16 natively), fp32
batches of a few rows on the native library's `few_rows_linear`.

- bf16: the packed LM head ran 4x faster than `F.linear` at M = 32 on an AVX512-BF16 host.
- fp32: MKL's sgemm, packed (`_mkl_reorder_linear_weight`, which this module used before) or not, read a
  decode step's weights at 3-7 GB/s on a 2-core AVX2 EPYC that streams memory at ~30 GB/s; `few_rows_linear`
  (kernels/cpu/native/few_rows.cpp) reads each weight row once and multiplies it by every row of the batch
  (ops/bench/few_rows.py, ops/bench/RESULTS.md). Up to `FEW_ROWS_MAX_ROWS` rows it runs there, on the plain
  weight (no packed copy); larger batches (prefill) run `F.linear`. Its sums round in another order than a
  BLAS sgemm (relative differences ~1e-6): fp32 greedy parity with transformers still holds
  (tests/integration/test_smollm2_parity.py).

The plain weight stays the module's `weight` (shared with tied embeddings, read by the bf16 logits
refinement).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import native

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM

PACKED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FEW_ROWS_MAX_ROWS = 64
"""fp32 batches up to this many rows run on `few_rows_linear`: measured faster than MKL's packed and plain
sgemm from 1 to 64 rows on an AVX2 EPYC; from 128 rows MKL was level or ahead (ops/bench/RESULTS.md)."""


def packing_kind(dtype: torch.dtype) -> str | None:
    """'mkldnn' (bf16 where oneDNN computes it natively), 'few_rows' (fp32, with the native library loaded)
    or None when the native step has nothing better than `F.linear` for `dtype` here."""
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "mkldnn"
    if dtype == torch.float32 and native.is_loaded():
        return "few_rows"
    return None


class PackedLinear(nn.Module):
    """`linear` as the native step runs it; forward(x [M, in]) -> [M, out] as `linear(x)`."""

    packed: torch.Tensor | None  # oneDNN's copy of the weight (a buffer, not saved with the model); None for few_rows

    def __init__(self, linear: nn.Linear, kind: str, batch_hint: int = 32) -> None:
        super().__init__()
        if kind not in ("mkldnn", "few_rows"):
            raise ValueError(f"unknown packing kind {kind!r}")
        self.weight, self.bias = linear.weight, linear.bias
        self.kind = kind
        packed = None
        if kind == "mkldnn":
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.register_buffer("packed", packed, persistent=False)

    def row_kernel_for(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`few_rows_linear` bound to this layer's weights where a batch of `rows` rows runs on it (for the
        decode step's plan, workers/models/layer_plan.py); None otherwise."""
        if self.kind != "few_rows" or rows > FEW_ROWS_MAX_ROWS:
            return None
        return functools.partial(torch.ops.tollway_cpu.few_rows_linear.default, weight=self.weight, bias=self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "few_rows":
            if x.dim() == 2 and x.shape[0] <= FEW_ROWS_MAX_ROWS:
                return _few_rows_linear(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)
        assert self.packed is not None  # mkldnn
        if torch.compiler.is_compiling():  # traced by torch.compile: one opaque op (see packed_linear_op)
            return packed_linear_op(x, self.packed, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.tollway_cpu.few_rows_linear(x, weight, bias)


@torch.library.custom_op("tollway_packed::linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's packed matmul as one op inductor calls as it is: its own lowering of the packed linear
    requires frozen (constant) weights, which a compiled step with its weights as inputs does not have
    (workers/engine/compiled_decode.py). `weight` only gives the output's width to the fake."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear_op.register_fake
def _packed_linear_fake(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def pack_linears(model: LlamaForCausalLM, batch_hint: int = 32) -> bool:
    """Replace every decoder layer's projections and the LM head by packed ones (once: a packed
    model is left as it is; so are quantized projections, `QuantizedLinear`s, which bring their own
    packing; a quantized head's float head is packed). False when the native step has no packing for
    the model's dtype here (`packing_kind`)."""
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
