"""A GGUF's quantized linear weights read as they are stored (Q4_0, Q4_1, Q8_0 blocks of 32) into
the layout of kernels/quantized/layout.py, without a round trip through floats.

Block formats (ggml, 32 weights along the input dimension each; fp16 d and m):

- Q4_1: d, m, 16 bytes; weight j = q_j * d + m, q_j the low nibble of byte j (j < 16) or the high
  nibble of byte j - 16. -> int4, scale d, min m (exact: the layout is Q4_1's own arithmetic).
- Q4_0: d, 16 bytes as Q4_1; weight j = (q_j - 8) * d. -> int4, scale d, min -8 d (exact).
- Q8_0: d, 32 int8; weight j = q_j * d. -> int8 in groups of 32 (exact), to be requantized per
  channel for the int8 matmul (workers/models/quantize.py says with what error).

The nibble order differs from the layout's (column 2j low, 2j + 1 high), so codes are unpacked and
repacked; that is exact. GGUF lists dims innermost first: a [N, K] weight has ne = (K, N), and its
raw data is N rows of K / 32 blocks. llama.cpp's converter permutes the rows of llama-family q and
k weights (rotary pairs interleaved); transformers' GGUF loader undoes it
(`LlamaTensorProcessor._reverse_permute_weights`), and so does `permute_rows` here (for the
architectures in `ROW_PERMUTED_ARCHITECTURES`), on whole rows: groups run along K, so a row's
blocks move with it. The file's tensor table comes from workers/models/gguf_file.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from kernels.quantized.layout import QuantizedWeight, pack_int4
from workers.models.gguf_file import GGUFTensor, read_gguf

BLOCK = 32
PROJECTION_TENSORS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}
"""Our fused projections and the GGUF tensors (blk.<i>.<name>.weight) they stack, in row order."""
INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
INT8_TYPES = (GGMLQuantizationType.Q8_0,)
ROW_PERMUTED_ARCHITECTURES = ("llama",)
"""Architectures whose attn_q / attn_k rows llama.cpp permuted (transformers' TENSOR_PROCESSORS)."""


def _fp16(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block [..., type_size] -> fp32 [...]."""
    raw = np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(raw.astype(np.float32))


def block_weight(tensor: GGUFTensor) -> QuantizedWeight:
    """The [N, K] weight of a Q4_0, Q4_1 or Q8_0 tensor in the layout (group size 32)."""
    kind = GGMLQuantizationType(tensor.tensor_type)
    if len(tensor.shape) != 2 or int(tensor.shape[0]) % BLOCK:
        raise ValueError(f"{tensor.name}: not a 2-D weight of whole {BLOCK}-blocks (ne {list(tensor.shape)})")
    k, n = int(tensor.shape[0]), int(tensor.shape[1])
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // BLOCK, -1)
    if kind == GGMLQuantizationType.Q8_0:
        codes = np.ascontiguousarray(blocks[..., 2:2 + BLOCK]).view(np.int8).reshape(n, k)
        return QuantizedWeight(bits=8, qweight=torch.from_numpy(codes.copy()), scales=_fp16(blocks, 0),
                               mins=None, group_size=BLOCK)
    if kind not in INT4_TYPES:
        raise ValueError(f"{tensor.name}: {kind.name} blocks are not read quantized (Q4_0, Q4_1, Q8_0 are)")
    scales = _fp16(blocks, 0)
    first = 4 if kind == GGMLQuantizationType.Q4_1 else 2
    mins = _fp16(blocks, 2) if kind == GGMLQuantizationType.Q4_1 else -8 * scales
    nibbles = blocks[..., first:first + BLOCK // 2]  # [N, K / 32, 16]
    codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(n, k)  # GGUF order -> columns
    return QuantizedWeight(bits=4, qweight=pack_int4(torch.from_numpy(codes)), scales=scales, mins=mins,
                           group_size=BLOCK)


def permute_rows(weight: QuantizedWeight, heads: int) -> QuantizedWeight:
    """Undo llama.cpp's q/k row permutation for `heads` heads (new row r = old row perm[r])."""
    n = weight.shape[0]
    perm = torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
    return QuantizedWeight(bits=weight.bits, qweight=weight.qweight[perm].contiguous(),
                           scales=weight.scales[perm].contiguous(),
                           mins=None if weight.mins is None else weight.mins[perm].contiguous(),
                           group_size=weight.group_size)


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one input size and group stacked along the output dimension (fused projections)."""
    first = parts[0]
    if any(p.bits != first.bits or p.group_size != first.group_size or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("only weights of one format, group size and input size stack")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
    return QuantizedWeight(bits=first.bits, qweight=torch.cat([p.qweight for p in parts]),
                           scales=torch.cat([p.scales for p in parts]), mins=mins, group_size=first.group_size)


class GGUFLinears:
    """The decoder projections of one GGUF file, read block by block on request."""

    def __init__(self, path: Path, num_q_heads: int, num_kv_heads: int) -> None:
        self.path = path
        table = read_gguf(path)
        self.tensors, self.architecture = table.tensors, table.architecture
        self.heads = {"attn_q": num_q_heads, "attn_k": num_kv_heads}

    def types(self, layer: int, projection: str) -> set[GGMLQuantizationType]:
        """The GGML types of the tensors behind one projection (empty when the file lacks one)."""
        names = [f"blk.{layer}.{part}.weight" for part in PROJECTION_TENSORS[projection]]
        if any(name not in self.tensors for name in names):
            return set()
        return {GGMLQuantizationType(self.tensors[name].tensor_type) for name in names}

    def projection(self, layer: int, projection: str) -> QuantizedWeight:
        """One fused projection's weight [N, K] as stored (ValueError for other block types)."""
        parts = []
        for part in PROJECTION_TENSORS[projection]:
            weight = block_weight(self.tensors[f"blk.{layer}.{part}.weight"])
            if part in self.heads and self.architecture in ROW_PERMUTED_ARCHITECTURES:
                weight = permute_rows(weight, self.heads[part])
            parts.append(weight)
        return stack_rows(parts) if len(parts) > 1 else parts[0]
