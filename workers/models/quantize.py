"""Weight-only quantization of a loaded model's decoder projections (`TOLLWAY_QUANTIZATION`).

What is quantized: every decoder layer's four projections (qkv_proj, o_proj, gate_up_proj,
down_proj: ~80% of SmolLM2-135M's weight bytes once the tied embedding is counted once). The
embeddings and the float LM head stay in the model dtype: the head is tied to the embeddings in the
built-in model (one tensor serves both), a row lookup gains nothing from a matmul kernel, and the
logits refinement (`LlamaForCausalLM.logits`) reads exact `lm_head.weight` rows. On a CPU with the
native kernels the head also gets a copy in the format (int8, or int4 in groups of 32) for decode steps of
a few rows, whose top logits that refinement makes exact (workers/models/quantized_head.py); llama.cpp
keeps the built-in GGUF's tied head in 8 bits (Q8_0). The int4 copy reads 17 MB a token instead of 28 (6%
of an int4 single stream on a 2-core AVX2 host); the logits outside the refined top are coarser (ops/bench/
RESULTS.md, "Issue 22 on AVX2").

- int8: symmetric, one scale per output channel (`quantize_int8`): error at most half a step,
  max |w_row| / 254, per weight.
- int4: asymmetric, groups of `INT4_GROUP_SIZE` = 32 input columns with a scale and a min
  (`quantize_int4`, GGUF Q4_1's arithmetic): error at most half a step, (max - min) / 30 per group.

Where the folder was converted from a GGUF (`assets.source_gguf`) whose projection is stored as
Q4_0 / Q4_1 (int4) or Q8_0 (int8), its blocks are read as stored (workers/models/gguf_blocks.py)
instead, and used only where they dequantize exactly to the folder's floats (which the conversion
made from those same blocks): int4 from a Q4 GGUF is then lossless against the float model. A Q8_0
projection (groups of 32, one fp16 scale each) is requantized to one scale per channel, the form
the int8 kernels take: w = q_g * d_g becomes round(q_g * d_g / s) * s with s = max |w_row| / 127,
at most s / 2 off per weight (a Q8_0 block's own step is d_g <= s) — the same weights as quantizing
the folder's floats, since those are the blocks' values.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels.cpu import native
from kernels.quantized.layout import QuantizedWeight, dequantize, quantize_int4, quantize_int8
from workers.models.llama import FUSED_PROJECTIONS, DecoderLayer, LlamaForCausalLM, fused_weight
from workers.models.quantized_head import QuantizedHead
from workers.models.quantized_linear import QuantizedLinear

if TYPE_CHECKING:  # the gguf package (and its yaml) is imported only when a GGUF is read
    from workers.models.gguf_blocks import GGUFLinears

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32
"""GGUF's block size: the built-in model's Q4_1 blocks map onto it one to one."""


QUANTIZABLE_MODEL_TYPES = ("llama", "mistral", "qwen2")
"""The families whose decoder projections `quantize_model` knows (the other families of issue 26 have
fused checkpoints (phi3), experts (mixtral, qwen3_moe) or their own layers: not quantized yet)."""


class QuantizationError(ValueError):
    """A quantization that cannot be applied to this model; the message says why."""


@dataclass
class QuantizationSummary:
    """How many projections were read from the GGUF's blocks and how many quantized from floats."""

    quantization: str
    from_gguf: int = 0
    from_floats: int = 0


def check_quantization(quantization: str) -> int:
    """The bit width of `quantization` (0 for none); QuantizationError for an unknown name."""
    if quantization not in QUANTIZATIONS:
        raise QuantizationError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    return {"none": 0, "int8": 8, "int4": 4}[quantization]


def quantize_floats(weight: torch.Tensor, bits: int, where: str) -> QuantizedWeight:
    if bits == 8:
        return quantize_int8(weight)
    if weight.shape[1] % INT4_GROUP_SIZE:
        raise QuantizationError(f"{where}: in_features {weight.shape[1]} is not a multiple of the int4 group "
                                f"size {INT4_GROUP_SIZE}; use int8 or none for this model")
    return quantize_int4(weight, INT4_GROUP_SIZE)


def from_gguf(gguf: GGUFLinears, layer: int, projection: str, bits: int, floats: torch.Tensor) -> QuantizedWeight | None:
    """The projection from the GGUF's blocks, or None where they are of another type or not the
    folder's weights (a stale source record, an edited folder)."""
    from workers.models.gguf_blocks import INT4_TYPES, INT8_TYPES

    types = gguf.types(layer, projection)
    if not types or not types <= set(INT4_TYPES if bits == 4 else INT8_TYPES):
        return None
    weight = gguf.projection(layer, projection)
    if weight.shape != tuple(floats.shape) or not torch.equal(dequantize(weight), floats):
        log.warning("%s: layer %d %s differs from the folder's weights; quantizing the floats instead",
                    gguf.path, layer, projection)
        return None
    return quantize_int8(dequantize(weight)) if bits == 8 else weight


def quantize_model(model: LlamaForCausalLM, weights: dict[str, torch.Tensor], quantization: str,
                   gguf_path: Path | None = None, activations: str = "int8") -> QuantizationSummary:
    """Replace every decoder projection of `model` by a QuantizedLinear of `quantization`, from
    the source `weights` (Hugging Face names, as loaded) or the blocks of `gguf_path`; `activations`:
    what their decode steps take x as on a CPU (kernels/quantized/cpu.py `pack_for_cpu`)."""
    bits = check_quantization(quantization)
    summary = QuantizationSummary(quantization)
    if bits == 0:
        return summary
    if model.config.model_type not in QUANTIZABLE_MODEL_TYPES:
        raise QuantizationError(f"{quantization} weights are built for {', '.join(QUANTIZABLE_MODEL_TYPES)} "
                                f"models, not {model.config.model_type!r} (its projections load differently); "
                                "use --quantization none")
    c = model.config
    gguf: GGUFLinears | None = None
    if gguf_path is not None:
        from workers.models.gguf_blocks import GGUFLinears

        gguf = GGUFLinears(gguf_path, c.num_q_heads, c.num_kv_heads)
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        for name in FUSED_PROJECTIONS:
            floats = fused_weight(weights, i, name).float()
            weight = from_gguf(gguf, i, name, bits, floats) if gguf is not None else None
            if weight is None:
                weight = quantize_floats(floats, bits, f"layer {i} {name}")
                summary.from_floats += 1
            else:
                summary.from_gguf += 1
            old = getattr(layer, name)
            setattr(layer, name, QuantizedLinear(weight, old.bias, model.dtype, model.device,
                                                  activations=activations))
    if model.device.type == "cpu" and native.load() and model.lm_head.bias is None:
        model.lm_head = QuantizedHead(model.lm_head, model.dtype, activations, bits)
    release_freed_heap()
    return summary


def release_freed_heap() -> None:
    """Hand the quantization's freed temporaries back to the OS: glibc keeps freed chunks of a few MB
    in its heap once its mmap threshold has grown (measured: int8's RSS after load 1,159 MB without
    this, 614 MB with it)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:  # not glibc: nothing to trim this way
        pass
