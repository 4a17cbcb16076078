"""The decoder stack of a step whose tokens all attend as decode rows (decode steps, and mixed steps of short
contexts: workers/models/fused_decode.py) as one native call: the plan `torch.ops.tollway_cpu.decode_planned`
(kernels/cpu/native/layer_stack.cpp) runs, built once per model and row count.

The fused decode step (workers/models/fused_decode.py) calls ~9 ops per layer from Python, each with
microseconds of argument parsing and glue. The native op runs the same ops in the same order from C++
(measured on a 2-core AVX512-BF16 host, one stream of the default model: the int4 step 5.5-6.0 -> 4.7-5.3 ms,
bf16 single-stream decode +16%, int4 +25%; ops/bench/RESULTS.md). This module flattens what the op needs
(norm weights, each projection's kernel and its bound tensors, scales, windows) into its lists, in the
layout layer_stack.cpp documents.

A plan is what `linear_call` would run for each projection on `rows` rows at the time it
was built: it is kept per (rows, int8 activations on, the measured crossovers) on the model, and
rebuilt when any projection module was replaced since (pack_linears, quantization). Projections no
kind covers (a quantized layer above its row-kernel crossover, which dequantizes) give no plan: the
step then runs the Python loop.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kernels.quantized import cpu as quantized_cpu
from workers.models.packed_linear import PackedLinear

if TYPE_CHECKING:
    from cache.kv_storage import KVStorage
    from workers.models.llama import DecoderLayer, LlamaForCausalLM

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

# ProjectionKind of layer_stack.cpp, by the op that runs the projection.
_LINEAR, _MKLDNN, _FEW_ROWS, _INT4, _INT4_Q8, _INT8, _INT8_Q8, _AMX_ROWS = range(8)
_ROW_KERNEL_KINDS = {"tollway_cpu::int4_matmul": _INT4, "tollway_cpu::int4_matmul_q8": _INT4_Q8,
                     "tollway_cpu::int8_matmul": _INT8, "tollway_cpu::int8_matmul_q8": _INT8_Q8,
                     "tollway_cpu::few_rows_linear": _FEW_ROWS, "tollway_cpu::amx_rows_linear": _AMX_ROWS}

Entry = tuple[int, list[torch.Tensor | None], list[int]]
"""A projection in the plan: its kind, its 3 tensor slots, its 2 ints."""


@dataclass(frozen=True)
class LayerPlan:
    layer_indices: tuple[int, ...]
    tensors: list[torch.Tensor | None]
    ints: list[int]
    floats: list[float]
    heads: tuple[int, int, int]
    """(query heads, KV heads, head dim)."""
    handle: int = field(init=False)
    """The library's copy of the lists (`__post_init__`)."""

    def __post_init__(self) -> None:
        # The lists held by the library under a handle (layer_stack.cpp `register_layer_plan`): a step passes
        # the handle, not ~900 entries to parse; released with the plan.
        handle = torch.ops.tollway_cpu.register_layer_plan(self.tensors, self.ints, self.floats, *self.heads)
        object.__setattr__(self, "handle", handle)
        weakref.finalize(self, torch.ops.tollway_cpu.release_layer_plan, handle)

    def run(self, residual: torch.Tensor, kv: KVStorage, cos: torch.Tensor, sin: torch.Tensor,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        """The decoder stack on `residual` [N, H] fp32 (updated in place), writing each layer's K/V."""
        torch.ops.tollway_cpu.decode_planned(
            residual, cos, sin, slot_mapping, block_tables, context_lens,
            [kv.keys[i] for i in self.layer_indices], [kv.values[i] for i in self.layer_indices], self.handle)


def linear_call(module: torch.nn.Module, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a projection runs on `rows` rows: a quantized layer's row kernel straight (QuantizedLinear.row_kernel_for:
    no module call, no per-call checks; ~0.5 ms of a 12 ms int4 single-stream step on 2 cores) or an fp32 packed
    one's few_rows_linear (PackedLinear.row_kernel_for), else the module."""
    row_kernel_for = getattr(module, "row_kernel_for", None)
    run = row_kernel_for(rows) if row_kernel_for is not None else None
    return run if run is not None else module


def projection_entry(run: Any) -> Entry | None:
    """The plan's entry for what a projection runs (`linear_call`'s answer); None when no kind of
    layer_stack.cpp covers it."""
    if isinstance(run, functools.partial) and isinstance(run.func, torch._ops.OpOverload):
        kind = _ROW_KERNEL_KINDS.get(run.func._schema.name)
        kw = run.keywords
        if kind is None or run.args:
            return None
        if kind == _FEW_ROWS:
            return kind, [kw["weight"], kw["bias"], None], [0, 0]
        if kind == _AMX_ROWS:
            return kind, [kw["packed"], kw["bias"], None], [0, 0]
        if kind in (_INT4, _INT4_Q8):
            return kind, [kw["qweight"], kw["scales"], kw["mins"]], [kw["n"], kw["group"]]
        return kind, [kw["qweight"], kw["scales"], None], [kw["n"], 0]
    if isinstance(run, PackedLinear):
        if run.kind == "mkldnn":
            return _MKLDNN, [run.packed, run.bias, None], [0, 0]
        return _LINEAR, [run.weight, run.bias, None], [0, 0]  # fp32 past few rows: F.linear on the plain weight
    if type(run) is nn.Linear:
        return _LINEAR, [run.weight, run.bias, None], [0, 0]
    return None


def _current_modules(layers: list[DecoderLayer]) -> tuple[nn.Module, ...]:
    # The modules' own dicts: `getattr` on a module goes through nn.Module.__getattr__, ~10x slower.
    return tuple(layer._modules[name] for layer in layers for name in PROJECTIONS)  # type: ignore[misc]


def build_plan(model: LlamaForCausalLM, rows: int) -> LayerPlan | None:
    """The plan of `model`'s layers for steps of `rows` tokens as `linear_call` chooses now;
    None when a projection has no kind here."""
    layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
    tensors: list[torch.Tensor | None] = []
    ints: list[int] = []
    floats: list[float] = []
    for layer in layers:
        tensors += [layer.input_norm.weight, layer.post_attention_norm.weight]
        ints.append(layer.sliding_window or 0)
        floats += [layer.scale, layer.input_norm.eps, layer.post_attention_norm.eps]
        for name in PROJECTIONS:
            entry = projection_entry(linear_call(getattr(layer, name), rows))
            if entry is None:
                return None
            kind, slots, numbers = entry
            tensors += slots
            ints += [kind, *numbers]
    c = model.config
    return LayerPlan(tuple(layer.layer_index for layer in layers), tensors, ints, floats,
                     (c.num_q_heads, c.num_kv_heads, c.head_dim))


def plan_for(model: LlamaForCausalLM, rows: int) -> LayerPlan | None:
    """The model's plan for `rows` rows (built on first use, rebuilt when a projection was replaced), or None."""
    key = (rows, quantized_cpu.in_decode_step(), quantized_cpu.crossover_state())
    plans: dict[Any, tuple[tuple[nn.Module, ...], LayerPlan | None]] = model.__dict__.setdefault("_layer_plans", {})
    modules = _current_modules(list(model.layers))  # type: ignore[arg-type]
    known = plans.get(key)
    if known is None or known[0] != modules:
        if len(plans) > 64:
            plans.clear()
        known = plans[key] = (modules, build_plan(model, rows))
    return known[1]
