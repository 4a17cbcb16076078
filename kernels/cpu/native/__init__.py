"""The native CPU backend: C++ ops (`paged_decode.cpp`, `layer_ops.cpp`, `layer_stack.cpp`, `head_ops.cpp`, `decode_metadata.cpp`,
`quantized_matmul.cpp`, `quantized_q8.cpp` with its two kernels, one library defined by `tollway_cpu.cpp`, built by `build.py`) that
read the paged K/V cache in place, the fused small ops of the decode step and quantized matmuls.

`load()` builds (once per machine) and loads the library, and says whether the ops exist; when the
compiler is missing or the build fails it logs why, once, and returns False, and every caller
falls back to the torch CPU path (`kernels.cpu`). The ops, as `torch.ops.tollway_cpu.*`:

- `paged_decode(q [B, Hq, D], k_cache, v_cache, block_tables [B, M] int32, context_lens [B] int32,
  scale, window) -> [B, Hq, D]` (window 0 = none), D in {16, 32, 64, 128, 256}, Hq / Hkv <= 8; the
  caches hold q's dtype, fp16/bf16 under an fp32 q, or int8 rows with their scale (kernels/kv_int8.py)
  under either (`KV_CACHE_DTYPES`);
- `add_rms_norm(residual [N, H] fp32 (updated in place), x [N, H] | None, weight, eps) -> normed`;
- `rotary_store(qkv [N, (Hq + 2 Hkv) D] (q and k rotated in place), cos [N, D], sin, k_cache, v_cache,
  slots [N] int64, Hq, Hkv)`: also writes k and v at their slots (rounded to the caches' dtype, or
  quantized into an int8 cache exactly as `kv_int8.quantize` does);
- `silu_mul(gate_up [N, 2I]) -> [N, I]`;
- `refine_top_logits(logits [N, V] fp32 | bf16, weight [V, H] fp32 | bf16, normed [N, H] fp32, k) -> [N, V]
  fp32`: the logits in fp32 with the k largest of each row recomputed as `weight[v] . normed[n]` in fp32
  (`head_ops.cpp`; used through workers/models/logits_refine.py);
- `few_rows_linear(x [M, K] fp32, weight [N, K] fp32, bias [N]?) -> [M, N]`: `F.linear` for a decode step's
  few rows, each weight row read once for all of them (`few_rows.cpp`; workers/models/packed_linear.py); bf16 x
  and weight (M <= 64, K even) on AVX512-BF16, the plain weight streamed in tiles against every row of x (16
  rows a vector, or dot products below 16 rows; `few_rows_bf16.cpp`);
- `row_argmax(logits [N, V] fp32) -> [N] int64`: each row's first index of its maximum, as `max(dim=-1)`
  (`head_ops.cpp`; the sampler's greedy choice, workers/engine/sampler.py);
- `int4_matmul(x [M, K], qweight uint8 [N, K / 2], scales [N, G], mins [N, G], group) -> [M, N]` and
  `int8_matmul(x, qweight int8 [N, K], scales [N]) -> [M, N]`: weight-only quantized matmuls
  (`quantized_matmul.cpp`; used through kernels/quantized/cpu.py);
- `int4_matmul_q8` / `int8_matmul_q8` (same arguments, and `kernel="auto"`): the same products with x
  quantized to int8 per block of 32, on integer multiply-adds (`quantized_q8.cpp`: AVX512-VNNI's in
  `quantized_vnni.cpp` where the CPU has them, else AVX2's in `quantized_avx2.cpp`; `q8_kernel()` says which).
- `int4_tile_matmul` / `int8_tile_matmul` (x bf16, the same weight arguments): each group of 32 weight rows
  dequantized once into bf16 and every row of x multiplied by it on AVX512-BF16 (`quantized_tiles.cpp`; where
  `tile_matmul_available()`), from the row kernels' crossover on.

- `decode_metadata(rows [R, W] int32, row_index, context_lens, width, block_size) -> (block_tables,
  context_lens, positions, slot_mapping, query_start)`: an all-decode step's paged-attention metadata from
  the persistent block-table rows (`decode_metadata.cpp`; workers/engine/table_rows.py).
- `register_layer_plan(tensors, ints, floats, Hq, Hkv, D) -> handle`, `release_layer_plan(handle)` and
  `decode_planned(residual, cos, sin, slot_mapping, block_tables, context_lens, k_caches, v_caches, handle)`: an
  all-decode step's decoder stack in one call, the ops above in the order of workers/models/fused_decode.py's loop
  and each projection's kernel (plain, oneDNN packed, fp32 few rows, the quantized row kernels) called from C++, from the
  flat plan workers/models/layer_plan.py builds and registers once (`layer_stack.cpp`).

`store_kv`, `decode_step` and `extend_step` are the backend interface `kernels.dispatch` calls;
extends (prefill chunks) run on the torch CPU path.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from kernels import cpu
from kernels.cpu.native.build import BuildError, build
from kernels.cpu.native.fake import register_fakes
from kernels.metadata import PagedAttentionMetadata

log = logging.getLogger(__name__)

HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_GROUP = 8
DTYPES = (torch.float32, torch.bfloat16)
KV_CACHE_DTYPES = {torch.float32: (torch.float32, torch.float16, torch.bfloat16, torch.int8),
                   torch.bfloat16: (torch.bfloat16, torch.int8)}
"""For each compute dtype, the cache dtypes the attention ops read and write."""

__all__ = ["covers", "decode_step", "extend_step", "is_loaded", "load", "q8_kernel", "store_kv", "tile_matmul_available",
           "unavailable_reason"]

_loaded = False
"""Set once `load()` has loaded the library into this process (read by `is_loaded`, which never builds)."""


@cache
def _load() -> str | None:
    """None when the ops are loaded; else why not (logged once)."""
    global _loaded
    try:
        torch.ops.load_library(str(build()))
        register_fakes()  # so torch.compile can trace steps that call the ops (fake.py)
    except (BuildError, OSError, RuntimeError) as exc:
        reason = f"native CPU kernels unavailable, using the torch CPU path: {exc}"
        log.warning(reason)
        return reason
    _loaded = True
    return None


def load() -> bool:
    """Build (first use on this machine) and load the ops; False when they cannot be had here."""
    return _load() is None


def is_loaded() -> bool:
    """Whether this process has loaded the ops already (an engine on the native backend loads them at
    start); unlike `load()` it never starts a build, so code shared with the torch path may ask it."""
    return _loaded


def unavailable_reason() -> str | None:
    """Why `load()` failed, or None when the ops are loaded."""
    return _load()


@cache
def q8_kernel() -> str | None:
    """Which kernel runs the *_matmul_q8 ops here: "vnni" (AVX512-VNNI) or "avx2" (every other CPU the
    library builds on); None where the library cannot be loaded."""
    return str(torch.ops.tollway_cpu.q8_kernel()) if load() else None


@cache
def amx_rows_available() -> bool:
    """Whether `amx_rows_linear` runs here (the library loads, built for AVX512, on a CPU with AMX-BF16 whose
    kernel lets this process use the tiles)."""
    return load() and bool(torch.ops.tollway_cpu.amx_rows_available())


@cache
def tile_matmul_available() -> bool:
    """Whether the *_tile_matmul ops run here (the library loads, built for AVX512, on a CPU with AVX512-BF16)."""
    return load() and bool(torch.ops.tollway_cpu.tile_matmul_available())


def covers(head_dim: int, num_q_heads: int, num_kv_heads: int, dtype: torch.dtype,
           kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the native decode kernel handles this attention shape, compute dtype and cache dtype
    (None: the compute dtype)."""
    group = num_q_heads // max(num_kv_heads, 1)
    return (head_dim in HEAD_DIMS and num_q_heads % max(num_kv_heads, 1) == 0 and group <= MAX_GROUP
            and (kv_dtype or dtype) in KV_CACHE_DTYPES.get(dtype, ()))


store_kv = cpu.store_kv
extend_step = cpu.extend_step


def decode_step(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata, scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The decodes (the first `meta.num_decodes` sequences), attending in place over their blocks."""
    d = meta.num_decodes
    if not covers(q.shape[-1], q.shape[1], k_cache.shape[2], q.dtype, k_cache.dtype) or not load():
        return cpu.decode_step(q, k_cache, v_cache, meta, scale, sliding_window)
    return torch.ops.tollway_cpu.paged_decode(
        q, k_cache, v_cache, meta.block_tables[:d], meta.context_lens[:d], scale, sliding_window or 0)
