"""A linear layer whose weight is stored weight-only quantized (int8 or int4, the layout of
kernels/quantized/layout.py): forward(x [M, K]) -> [M, N] in x's dtype, as `nn.Linear` would.

On a CPU the weight is kept only in the packing of its CPU kernel (`kernel`, kernels/quantized/cpu.py:
tollway's native ops or torch's weight-only ops), made once here; on CUDA it stays in the layout and
runs through the Triton dequant-matmul kernels (`kernels.quantized.triton_matmul.quantized_matmul`,
imported on first use there only).
The quantized tensors are plain attributes, not parameters or buffers: `Module.to(dtype)` must not
cast the codes' scales, and the packing is device-specific, so a layer is built where it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.quantized.cpu import (
    CpuPacked,
    cpu_matmul,
    dequantize_from_rows,
    pack_for_cpu,
    rounds_activations,
    row_kernel,
)
from kernels.quantized.layout import QuantizedWeight


class QuantizedLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device | str = "cpu", kernel: str = "auto", activations: str = "int8") -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(self.device, dtype), requires_grad=False)
        self.packed: CpuPacked | None = None
        self.quantized: QuantizedWeight | None = None
        self.row_kernels: dict[bool, Callable[[torch.Tensor], torch.Tensor] | None] = {}
        if self.device.type == "cpu":
            self.packed = pack_for_cpu(weight, dtype, kernel, activations)
            # the decode step's calls, straight to the op: x as it is (False) or rounded to int8 (True)
            self.row_kernels = {rounded: row_kernel(self.packed, rounded)
                                for rounded in (False, self.packed.int8_activations)}
        else:
            self.quantized = QuantizedWeight(
                bits=weight.bits, qweight=weight.qweight.to(self.device), scales=weight.scales.to(self.device),
                mins=None if weight.mins is None else weight.mins.to(self.device), group_size=weight.group_size)

    def row_kernel_for(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The row kernel (its op, weight bound) that `forward` runs on a 2-D x of `rows` rows, or None where
        forward takes another way; for a caller making many such calls at once (the fused decode step: 120 a
        step for the default model), which then skips the module call and these checks."""
        if self.packed is None or self.bias is not None:
            return None
        rounded = rounds_activations(self.packed)
        run = self.row_kernels[rounded]
        return run if run is not None and rows < dequantize_from_rows(self.packed, rounded) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = self.row_kernel_for(x.shape[0]) if x.dim() == 2 else None
        if run is not None:
            return run(x)
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if self.packed is not None:
            out = cpu_matmul(flat, self.packed)
        else:
            from kernels.quantized.triton_matmul import quantized_matmul  # GPU only: Triton is loaded there

            assert self.quantized is not None
            out = quantized_matmul(flat, self.quantized)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def nbytes(self) -> int:
        """Bytes held by the quantized weight (codes, scales, zeros) and the bias."""
        held = self.packed.nbytes() if self.packed is not None else self.quantized.nbytes() if self.quantized else 0
        return held + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")
