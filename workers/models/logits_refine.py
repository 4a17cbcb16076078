"""Exact logits where they matter from an approximate LM head: the REFINED_TOP largest of each row
recomputed in fp32 from the float weight rows (why: `LlamaForCausalLM.logits`).

On a CPU whose process has the native ops loaded, one C++ pass per row does it
(`torch.ops.tollway_cpu.refine_top_logits`, kernels/cpu/native/head_ops.cpp): at batch 32 torch's
`.float()`, `topk`, row gather, `einsum` and `scatter_` over 49,152-wide rows cost about 4 ms of a
45 ms decode step. Elsewhere (GPU, or the native ops not loaded) the same in torch ops. Both pick
the k largest by the head's own logits and recompute exactly those; they differ only in the fp32
summation order of the recomputed dot products (and, where values tie at the k-th, which are kept).
"""

from __future__ import annotations

import torch

from kernels.cpu import native

REFINED_TOP = 64
"""Logits recomputed in fp32 per row when the head approximates them."""


def refine_top(logits: torch.Tensor, weight: torch.Tensor, exact_normed: torch.Tensor) -> torch.Tensor:
    """fp32 logits [n, V] from the head's `logits` (fp32 or bf16), the REFINED_TOP largest of each
    row replaced by `weight[v] . exact_normed[row]` in fp32. weight: the float head [V, H];
    exact_normed: the final norm's output in fp32 [n, H]."""
    k = min(REFINED_TOP, logits.shape[-1])
    if (logits.device.type == "cpu" and native.is_loaded() and weight.dtype in native.DTYPES
            and logits.dtype in native.DTYPES):
        return torch.ops.tollway_cpu.refine_top_logits(
            logits.contiguous(), weight.contiguous(), exact_normed.contiguous(), k)
    logits = logits.float()
    top = logits.topk(k, dim=-1).indices  # [n, k]
    exact = torch.einsum("nkh,nh->nk", weight[top].float(), exact_normed)  # the rows upcast: [n, k, H], cheap
    return logits.scatter_(1, top, exact)
