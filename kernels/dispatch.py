"""The one attention entry point the model calls: store the step's K/V, then attend.

A step runs on the backend named in its metadata (`PagedAttentionMetadata.backend`), which the
step's builder sets: the engine resolves its `attention` setting (`TOLLWAY_ATTENTION`, read by the
worker's settings) once, when it is built, with `select_backend`. `reference` is the slow torch
reference (for debugging a suspected kernel bug), `triton` the Triton kernels (on a CPU only under
`TRITON_INTERPRET=1`), `cpu` the torch CPU path, `native` the C++ CPU ops (`kernels/cpu/native`:
decode reads the paged cache in place; extends run on the CPU path); `auto`, and a step built
without a backend, pick by device: Triton on CUDA; on a CPU `native` when its library builds and
loads on this machine (built once, cached), else the CPU path (the reason is logged). Decode sequences (the first `meta.num_decodes`) go
to the backend's decode op, the rest to its extend op.
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal

import torch

from kernels import cpu, reference
from kernels.cpu import native
from kernels.metadata import BACKENDS, Backend, PagedAttentionMetadata

__all__ = ["BACKENDS", "AttentionChoice", "Backend", "paged_attention", "select_backend"]

AttentionChoice = Literal["auto", "reference", "cpu", "native", "triton"]


def select_backend(device: torch.device, choice: str = "auto") -> Backend:
    """The backend for a model on `device`: `choice` itself unless it is `auto` (the default)."""
    forced = choice.strip().lower()
    for backend in BACKENDS:
        if forced == backend:
            return backend
    if forced != "auto":
        raise ValueError(f"TOLLWAY_ATTENTION must be auto, {', '.join(BACKENDS)}; got {forced!r}")
    if device.type == "cuda":
        return "triton"
    return "native" if native.load() else "cpu"


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: PagedAttentionMetadata, scale: float, sliding_window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] of the step's new tokens -> attention output [N, Hq, D].

    softcap (Gemma 2's attention-logit capping): only the torch reference implements it, so those
    layers attend there on every backend (correct, slow); the backend still stores the K/V.
    """
    backend = meta.backend
    if backend is None:  # chosen by device once, by the first layer; the others reuse it
        backend = meta.backend = select_backend(q.device)
    ops = _backend_module(backend)
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    d = meta.num_decodes
    if softcap is not None:
        parts = []
        if d:
            parts.append(reference.decode_step(q[:d], k_cache, v_cache, meta, scale, sliding_window, softcap))
        if d < meta.num_seqs:
            parts.append(reference.extend_step(q[d:], k[d:], v[d:], k_cache, v_cache, meta, scale, sliding_window,
                                               softcap))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
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
    if backend == "native":
        return native
    return cpu if backend == "cpu" else reference
