"""The native decode step's linear layers (issue 21): bf16 weights prepacked for oneDNN
(`mkldnn._reorder_linear_weight` + `_linear_pointwise`, only where oneDNN computes bf16 natively), fp32
batches of a few rows on the native library's `few_rows_linear`.

- bf16: the packed LM head ran 4x faster than `F.linear` at M = 32 on an AVX512-BF16 host. For
  `BF16_FEW_ROWS` rows (`BF16_FEW_ROWS_HEAD` in the LM head) on a CPU with AVX512-BF16 and no AMX,
  `few_rows_linear`'s bf16 kernel (kernels/cpu/native/few_rows_bf16.cpp) runs instead: a decode step's
  projections and LM head at 32 rows took 12.1 ms there against oneDNN's 15.6 on a Zen 5 EPYC
  (ops/bench/RESULTS.md). On a CPU with AMX-BF16, batches of `AMX_ROWS` rows run on `amx_rows_linear`
  (kernels/cpu/native/few_rows_amx.cpp) over a tile-packed copy of the weight: about half oneDNN's time there.
  Other row counts and prefill keep oneDNN.
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
BF16_FEW_ROWS = frozenset([*range(1, 5), *range(16, 49)])
"""bf16 batches of these many rows run on `few_rows_linear` in the projections (where
`bf16_few_rows_available`); on a Zen 5 EPYC (`ops/bench/few_rows.py --dtype bfloat16`) against oneDNN's
packed GEMM: from 16 to 48 rows (a 16-row tile of x) it led on every projection (up to 1.8x at 48) and was
level on the LM head at 16-17; from 1 to 4 rows (dot products, no padded rows) it read the projections'
weights 6-67% faster; from 8 to 15 rows oneDNN led or was level (compute-bound there: the dot products' 16
accumulators), and from 49 on the LM head and gate_up."""
BF16_FEW_ROWS_HEAD = frozenset(range(16, 49))
"""The same for the LM head: from 1 to 2 rows oneDNN read its 57 MB faster (70 vs 52 GB/s at one row)."""
AMX_ROWS = frozenset(range(1, 33))
"""bf16 batches of these many rows run on `amx_rows_linear` (kernels/cpu/native/few_rows_amx.cpp) where the CPU has
AMX-BF16, every projection and the LM head. On a 2-core Emerald Rapids Xeon, the engine's decode step alternating
with oneDNN's AMX GEMM (its packed weights) in one process: the matmuls of a step 39.7 -> 19.0 ms at 4 rows and
51.2 -> 30.4 ms at 32; a single stream's step 36.9 -> 20.6 ms (ops/bench/RESULTS.md). Past 32 rows (prefill
chunks) oneDNN runs."""


def pack_amx_rows(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (N, K multiples of 32) as `amx_rows_linear`'s tiles [N / 32, K / 32, 2, 16, 32]: for each
    32 columns and 32 of K, each 16-column half's B tile, row r holding K pair (2r, 2r + 1) of its columns."""
    n, k = weight.shape
    tiles = weight.detach().reshape(n // 32, 2, 16, k // 32, 16, 2)  # [group, half, column, k step, pair, 2]
    return tiles.permute(0, 3, 1, 4, 2, 5).reshape(n // 32, k // 32, 2, 16, 32).contiguous()


def packing_kind(dtype: torch.dtype) -> str | None:
    """'mkldnn' (bf16 where oneDNN computes it natively), 'few_rows' (fp32, with the native library loaded)
    or None when the native step has nothing better than `F.linear` for `dtype` here."""
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "mkldnn"
    if dtype == torch.float32 and native.is_loaded():
        return "few_rows"
    return None


def bf16_few_rows_available() -> bool:
    """Whether bf16 batches of a few rows run on `few_rows_linear` here: the native library is loaded, built
    for AVX512 on a CPU with AVX512-BF16 (what its tile kernels need too), and the CPU has no AMX (oneDNN's
    AMX kernels are left as they are: not measured against)."""
    from workers.precision import cpu_has_amx_bf16  # here: workers.precision imports this module

    return native.is_loaded() and native.tile_matmul_available() and not cpu_has_amx_bf16()


class PackedLinear(nn.Module):
    """`linear` as the native step runs it; forward(x [M, in]) -> [M, out] as `linear(x)`."""

    packed: torch.Tensor | None  # oneDNN's copy of the weight (a buffer, not saved with the model); None for few_rows
    amx_packed: torch.Tensor | None  # amx_rows_linear's copy (a buffer, not saved) where AMX runs decode rows

    def __init__(self, linear: nn.Linear, kind: str, batch_hint: int = 32,
                 bf16_rows: frozenset[int] = BF16_FEW_ROWS) -> None:
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
        amx = (kind == "mkldnn" and linear.weight.dtype == torch.bfloat16 and linear.out_features % 32 == 0
               and linear.in_features % 32 == 0 and native.amx_rows_available())
        # A second copy of the weight (the model's bf16 weights again) where AMX runs the decode rows.
        self.register_buffer("amx_packed", pack_amx_rows(linear.weight) if amx else None, persistent=False)
        self.bf16_rows = bf16_rows  # the batch sizes the bf16 kernel runs, where it runs here at all
        self.bf16_few_rows = (kind == "mkldnn" and linear.in_features % 2 == 0
                              and linear.weight.is_contiguous() and bf16_few_rows_available())

    def runs_few_rows(self, rows: int) -> bool:
        """Whether a batch of `rows` rows runs on `few_rows_linear` (fp32, or bf16 where `bf16_few_rows`)."""
        if self.kind == "few_rows":
            return rows <= FEW_ROWS_MAX_ROWS
        return self.bf16_few_rows and rows in self.bf16_rows

    def runs_amx_rows(self, rows: int) -> bool:
        """Whether a batch of `rows` rows runs on `amx_rows_linear` (bf16 on an AMX CPU, AMX_ROWS)."""
        return self.amx_packed is not None and rows in AMX_ROWS

    def row_kernel_for(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`few_rows_linear` or `amx_rows_linear` bound to this layer's weights where a batch of `rows` rows runs
        on it (for the decode step's plan, workers/models/layer_plan.py); None otherwise."""
        if self.runs_amx_rows(rows):
            return functools.partial(torch.ops.tollway_cpu.amx_rows_linear.default, packed=self.amx_packed,
                                     bias=self.bias)
        if not self.runs_few_rows(rows):
            return None
        return functools.partial(torch.ops.tollway_cpu.few_rows_linear.default, weight=self.weight, bias=self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and self.kind == "mkldnn":  # one opaque op (see packed_linear_op)
            assert self.packed is not None
            return packed_linear_op(x, self.packed, self.weight, self.bias)
        if x.dim() == 2 and self.runs_amx_rows(x.shape[0]):
            assert self.amx_packed is not None
            return _amx_rows_linear(x, self.amx_packed, self.bias)
        if x.dim() == 2 and self.runs_few_rows(x.shape[0]):
            return _few_rows_linear(x, self.weight, self.bias)
        if self.kind == "few_rows":
            return F.linear(x, self.weight, self.bias)
        assert self.packed is not None  # mkldnn
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.tollway_cpu.few_rows_linear(x, weight, bias)


def _amx_rows_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.tollway_cpu.amx_rows_linear(x, packed, bias)


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
            rows = BF16_FEW_ROWS_HEAD if (owner, name) == head_owner else BF16_FEW_ROWS
            setattr(owner, name, PackedLinear(linear, kind, batch_hint, rows))
    return True
