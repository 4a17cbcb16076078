"""What an engine runs its model on: the KV cache's size and dtype, the attention backend, and the
step runner (eager, CUDA-graphed or compiled decode), chosen once from the engine's settings.

Ownership: the returned `KVCacheManager` owns the block ids; the `ModelRunner` owns the K/V storage
they index (plus one padding block when decode is graphed or compiled).
"""

from __future__ import annotations

import logging

from cache.kv_layout import KVLayout
from cache.kv_storage import KVStorage
from cache.manager import KVCacheManager
from kernels.dispatch import select_backend
from kernels.quantized import crossover
from workers.engine.compiled_decode import CompiledDecode, compile_wanted
from workers.engine.config import EngineConfig
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.runner import BucketedDecode, ModelRunner
from workers.models.loader import LoadedModel
from workers.models.packed_linear import pack_linears
from workers.models.quantized_linear import QuantizedLinear
from workers.precision import resolve_kv_cache_dtype

log = logging.getLogger(__name__)


def build_runner(loaded: LoadedModel, config: EngineConfig) -> tuple[KVCacheManager, ModelRunner]:
    """The block manager and the model runner for `loaded` under `config`."""
    model = loaded.model
    c = model.config
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype, model.device.type)
    backend = select_backend(model.device, config.attention)
    if backend == "native":  # the native decode step's matmuls run on prepacked weights
        pack_linears(model)
    # Quantized projections: where their row kernels stop paying on this CPU (once per process).
    crossover.calibrate([m.packed for m in model.modules() if isinstance(m, QuantizedLinear) and m.packed is not None])
    # Models whose step syncs with the host (Gemma 2's capped reference attention) say so: not capturable.
    graphs = config.cuda_graphs and model.device.type == "cuda" and model.cuda_graphs_ok
    compiled = config.compile == "decode" and compile_wanted(model, backend, kv_dtype)  # logs when it cannot
    layout = kv_layout(c.layer_windows, compiled)
    num_blocks = config.num_blocks or max(
        1, config.kv_budget_bytes // KVStorage.bytes_per_block(
            layout.layers_per_page, config.block_size, c.num_kv_heads, c.head_dim, kv_dtype))
    cache = KVCacheManager(num_blocks, config.block_size, layout)
    # With CUDA graphs or a compiled step the storage holds one more block than the pool hands out:
    # the padding rows'.
    kv = model.allocate_kv(num_blocks + (graphs or compiled), config.block_size, kv_dtype, layout)
    bucketed: BucketedDecode | None = None
    if graphs:
        bucketed = DecodeGraphs(model, kv, num_blocks, backend)
        bucketed.warm_up()
    elif compiled:
        bucketed = CompiledDecode(model, kv, num_blocks, backend)
    return cache, ModelRunner(model, kv, backend, bucketed)


def kv_layout(layer_windows: tuple[int | None, ...], compiled: bool) -> KVLayout:
    """The layers' groups (cache/kv_layout.py). A compiled decode step takes one block table, so a
    model mixing windows then keeps every layer's blocks in one group (nothing is given back early:
    correct, with less room for long contexts); only Llama-family layers compile, and they share one
    window, so this is a guard."""
    layout = KVLayout.for_windows(layer_windows)
    if layout.num_groups > 1 and compiled:
        log.info("one KV block table for all layers: the compiled decode step takes one")
        return KVLayout.single(len(layer_windows))
    return layout
