"""The one attention entry point the model calls: store the step's K/V, then attend.

Backend by device: Triton kernels on CUDA, the torch CPU path elsewhere. `TOLLWAY_ATTENTION`
overrides: `reference` forces the slow torch reference (for debugging a suspected kernel bug),
`triton` forces the Triton kernels (on a CPU only under `TRITON_INTERPRET=1`), `cpu` the CPU path;
`auto` (the default) picks by device. Decode sequences (the first `meta.num_decodes`) go to the
decode op, the rest to the extend op.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Literal

import torch

from kernels import cpu, reference
from kernels.metadata import PagedAttentionMetadata

Backend = Literal["reference", "cpu", "triton"]
BACKENDS: tuple[Backend, ...] = ("reference", "cpu", "triton")


def select_backend(device: torch.device) -> Backend:
    forced = os.environ.get("TOLLWAY_ATTENTION", "auto").strip().lower()
    if forced in BACKENDS:
        return forced  # type: ignore[return-value]
    if forced != "auto":
        raise ValueError(f"TOLLWAY_ATTENTION must be auto, {', '.join(BACKENDS)}; got {forced!r}")
    return "triton" if device.type == "cuda" else "cpu"


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: PagedAttentionMetadata, scale: float, sliding_window: int | None = None,
) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] of the step's new tokens -> attention output [N, Hq, D]."""
    backend = meta.prepared.get("backend")
    if backend is None:
        backend = meta.prepared["backend"] = select_backend(q.device)
    ops = _backend_module(backend)
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    d = meta.num_decodes
    parts = []
    if d:
        parts.append(ops.decode_step(q[:d], k_cache, v_cache, meta, scale, sliding_window))
    if d < meta.num_seqs:
        parts.append(ops.extend_step(q[d:], k[d:], v[d:], k_cache, v_cache, meta, scale, sliding_window))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _backend_module(backend: Backend) -> ModuleType:
    if backend == "triton":
        from kernels import triton as triton_backend  # imported on first use: CPU runs never build a kernel

        return triton_backend
    return cpu if backend == "cpu" else reference
