"""The storage layout of a weight-only quantized [out, in] matrix, and its torch reference.

Two formats, both row-major over the output dimension N and grouped along the input dimension K
in groups of `group_size` consecutive columns (`group_size == K` means one group per row):

- **int8** (`bits == 8`), symmetric: `qweight` int8 [N, K], `scales` [N, K // group_size], no
  `mins`; weight = q * scale. Quantized afresh per output channel (group_size == K).
- **int4** (`bits == 4`), asymmetric: `qweight` uint8 [N, K // 2] holding two 4-bit codes per byte,
  column 2j in the low nibble and column 2j + 1 in the high nibble; `scales` and `mins`
  [N, K // group_size]; weight = q * scale + min with q in [0, 15]. This is GGUF's Q4_1 block as it
  is (Q4_0 is the case min = -8 * scale), and torch's int4pack convention with
  zero = min + 8 * scale.

`scales` and `mins` are float32 here whatever the model dtype; a backend converts them once when it
prepares its own packing. Invariant: K is a multiple of group_size, and group_size is even.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_MAX = 15
INT8_MAX = 127


@dataclass(frozen=True)
class QuantizedWeight:
    bits: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group_size: int

    def __post_init__(self) -> None:
        n = self.scales.shape[0]
        k = self.qweight.shape[1] * (2 if self.bits == 4 else 1)
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size % 2 or k % self.group_size or self.scales.shape != (n, k // self.group_size):
            raise ValueError(f"scales {tuple(self.scales.shape)} do not tile a [{n}, {k}] weight "
                             f"in groups of {self.group_size}")
        if (self.bits == 4) != (self.mins is not None):
            raise ValueError("int4 weights carry mins, int8 weights do not")
        if self.mins is not None and self.mins.shape != self.scales.shape:
            raise ValueError("mins and scales differ in shape")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features N, in_features K) of the float weight this stands for."""
        k = self.qweight.shape[1] * (2 if self.bits == 4 else 1)
        return self.qweight.shape[0], k

    def nbytes(self) -> int:
        parts = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15] of shape [N, K] (K even) -> [N, K // 2], column 2j in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 [N, K // 2] -> codes uint8 [N, K]."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def codes(weight: QuantizedWeight) -> torch.Tensor:
    """The integer codes [N, K]: int8 values, or int4 codes in [0, 15] (uint8)."""
    return unpack_int4(weight.qweight) if weight.bits == 4 else weight.qweight


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] the quantized one stands for (computed in fp32, returned in `dtype`)."""
    n, k = weight.shape
    groups = k // weight.group_size
    q = codes(weight).float().view(n, groups, weight.group_size)
    w = q * weight.scales.float().unsqueeze(-1)
    if weight.mins is not None:
        w = w + weight.mins.float().unsqueeze(-1)
    return w.view(n, k).to(dtype)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8: scale = max |w| / 127 per row (1 for an all-zero row)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return QuantizedWeight(bits=8, qweight=q, scales=scale, mins=None, group_size=w.shape[1])


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric group-wise int4 (min-max per group of `group_size` input columns, as GGUF Q4_1):
    scale = (max - min) / 15, min = the group's minimum; a constant group gets scale 1 (exact)."""
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"in_features {k} is not a multiple of the (even) group size {group_size}")
    grouped = w.view(n, k // group_size, group_size)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scale = (high - low) / INT4_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((grouped - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, INT4_MAX)
    return QuantizedWeight(bits=4, qweight=pack_int4(q.view(n, k)), scales=scale, mins=low, group_size=group_size)
