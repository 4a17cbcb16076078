"""What an engine reports about itself (`Engine.info`): its model, KV cache, finished and running
requests, scheduling and speculation; the worker's `GET /info` and its metrics are built from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.engine import Engine


def describe(engine: Engine) -> dict[str, object]:
    """The engine's model, cache, requests and scheduling, as `GET /info` and the metrics report them."""
    held, capacity = engine.kv_utilization()
    stats = engine.cache.stats()
    return {
        "model": engine.name,
        "dtype": str(engine.loaded.model.dtype).removeprefix("torch."),
        "quantization": engine.loaded.quantization,
        "quantized_activations": engine.loaded.activations if engine.loaded.quantization != "none" else None,
        "kv_cache_dtype": str(engine.runner.kv.keys[0].dtype).removeprefix("torch."),  # what the blocks hold
        "context_length": engine.max_context,
        "block_size": stats.block_size,
        "blocks": {"total": stats.num_blocks, "free": stats.num_free, "used": stats.num_used,
                   "evictable": stats.num_evictable},
        "kv_utilization": held / capacity if capacity else None,
        "cache": stats.namespaces,
        "finished": dict(engine.finished_counts),
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "preemptions": engine.scheduler.preemptions,
        "scheduling": engine.scheduler.policy,
        "tenants": engine.scheduler.tenant_stats(),
        "speculative": {"mode": engine.config.speculative, **engine.spec_stats.as_dict()},
    }
