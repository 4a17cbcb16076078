"""The LM head of a quantized model (`TOLLWAY_QUANTIZATION` int8 / int4, on a CPU): a copy in the model's
weight format (int8 per output channel, or int4 in groups of 32) for decode steps of a few rows, the float
head for everything else.

At one stream the head is the single largest matmul of a quantized decode step: 49,152 x 576 weights
for SmolLM2-135M, 57 MB in bf16, read whole for every token (23% of an int4 step on an AVX512-BF16
host, ops/bench/RESULTS.md "Issue 22"). llama.cpp keeps the same tied tensor in 8 bits (the built-in
GGUF's Q8_0 `token_embd`). Here the head gets an int8 per-output-channel copy (half the bytes; int4 models
an int4 one, a quarter, since the refinement below makes its top exact all the same) run by
the native row kernel when a step has at most `QUANTIZED_HEAD_MAX_ROWS` rows; from there on the
float head (prepacked by the engine like any linear) is faster than dequantizing, and it serves
prefill, so prompt logprobs stay those of the float head.

Quality: the copy's logits are approximate (at most half a step per weight: max |w_row| / 254 in int8,
a group's scale / 2 in int4), so
`LlamaForCausalLM.logits` recomputes the REFINED_TOP largest of each row in fp32 from the float
rows whenever `approximates(rows)` says so, in fp32 as in bf16: the argmax, the top logprobs and
nearly all the probability mass are the float head's.

Ownership: `float_head` is the model's original head (its weight tied to the embeddings where the
checkpoint ties them); `packed` is owned here, built once at quantization.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.quantized.cpu import CpuPacked, cpu_matmul, pack_for_cpu
from kernels.quantized.layout import quantize_int4, quantize_int8

QUANTIZED_HEAD_MAX_ROWS: dict[torch.dtype, int] = {torch.bfloat16: 4, torch.float32: 8}
"""Rows up to which the int8 row kernel beats the float head's packed GEMM (ops/bench/quantization.py's
linear table: bf16 int8 7.7 vs 22.8 ms at M = 1, 34.4 vs 26.4 at M = 8; fp32 7.2 vs 49.1 at M = 1,
35.3 vs 76.8 at M = 8, the fp32 row kernel then loses at 16)."""


HEAD_INT4_GROUP = 32
"""An int4 model's head copy: groups of 32 with a scale and a min (as GGUF's Q4_1)."""


class QuantizedHead(nn.Module):
    float_head: nn.Module  # an nn.Linear, or the engine's PackedLinear of it (packed_linear.pack_linears)
    max_rows: int

    def __init__(self, float_head: nn.Linear, dtype: torch.dtype, activations: str = "int8", bits: int = 8) -> None:
        super().__init__()
        if float_head.bias is not None:
            raise ValueError("a quantized LM head takes a head without bias")
        if bits not in (4, 8):
            raise ValueError(f"a quantized LM head is int8 or int4, not {bits} bits")
        self.float_head = float_head
        self.max_rows = QUANTIZED_HEAD_MAX_ROWS.get(dtype, 0)
        with torch.no_grad():
            floats = float_head.weight.detach().float()
            weight = quantize_int8(floats) if bits == 8 else quantize_int4(floats, HEAD_INT4_GROUP)
            self.packed: CpuPacked = pack_for_cpu(weight, dtype, "native", activations)

    @property
    def weight(self) -> torch.Tensor:
        """The float head's weight (the logits refinement reads its rows; tied to the embeddings)."""
        weight = self.float_head.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def approximates(self, rows: int) -> bool:
        """Whether a call on `rows` rows runs the int8 copy (its logits then want refining)."""
        return rows <= self.max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.approximates(x.shape[0]):
            return cpu_matmul(x, self.packed)
        return self.float_head(x)

    def nbytes(self) -> int:
        """Bytes of the int8 copy (the float head's are counted with the embeddings)."""
        return self.packed.nbytes()


def head_approximates(head: nn.Module, rows: int) -> bool:
    """Whether `head` (a model's lm_head) gives approximate logits for a call on `rows` rows."""
    return isinstance(head, QuantizedHead) and head.approximates(rows)
