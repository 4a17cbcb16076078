"""The decode step compiled with `torch.compile` (inductor, CPU) per batch bucket (issue 21):
`TOLLWAY_COMPILE=decode` (`EngineConfig.compile`). Off by default: on this project's 2-core AVX2
host it did not beat the eager native step clearly (ops/bench/RESULTS.md, "Decode step at its
matmuls"), and each new bucket costs a compile the first time it is used.

An all-decode step of at most the largest bucket's sequences is padded with dummy rows to its batch
bucket (graph_buckets.py: they read and write only the reserved `dummy_block`), its block tables
are widened to the context bucket (padded with the dummy block), and the step runs as one compiled
graph (workers/models/fixed_decode.py) of fixed shapes: one graph per (batch bucket, context
bucket), never a dynamic one (`dynamic=False`). Other steps (prefill chunks, drafts, prompt
logprobs, batches beyond the largest bucket) return None and run eagerly as before.

A compile that fails (an op dynamo cannot trace on some model) is logged once and turns the
compiled path off for this engine: the step is redone eagerly, and so are all later ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from cache.kv_storage import KVStorage
from kernels.metadata import Backend, PagedAttentionMetadata
from kernels.quantized import cpu as quantized_cpu
from workers.engine.graph_buckets import DEFAULT_BATCH_BUCKETS, batch_bucket, context_bucket, pad_decode_batch
from workers.models.fixed_decode import decode_logits
from workers.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

COMPILE_BACKENDS: tuple[Backend, ...] = ("cpu", "native")
"""The attention backends whose decode step has a compiled form."""
CONTEXT_BUCKETS = 6
"""Context buckets a worker meets (256 ... 8192, graph_buckets.context_bucket): with the batch buckets,
the most graphs dynamo may keep for the step before it gives up compiling new ones."""


def can_compile(model: LlamaForCausalLM, backend: Backend, kv_dtype: torch.dtype | None = None) -> bool:
    """Plain Llama-layer models (the layers fixed_decode knows) on the CPU, on a backend it covers; a KV
    cache narrower than the model (`TOLLWAY_KV_CACHE_DTYPE`) on the native backend only."""
    narrow_cache = kv_dtype is not None and kv_dtype != model.dtype
    return (model.fused_decode_ok and model.device.type == "cpu" and backend in COMPILE_BACKENDS
            and (backend == "native" or not narrow_cache))


def compile_wanted(model: LlamaForCausalLM, backend: Backend, kv_dtype: torch.dtype | None = None) -> bool:
    """`can_compile`, logging why not when the setting asks for a compiled step that cannot be had."""
    if can_compile(model, backend, kv_dtype):
        return True
    log.warning("TOLLWAY_COMPILE=decode: no compiled decode step for %s on backend %s (CPU, plain Llama "
                "layers, cpu or native attention only; a narrower KV cache on native only); decoding eagerly",
                type(model).__name__, backend)
    return False


class CompiledDecode:
    def __init__(self, model: LlamaForCausalLM, kv: KVStorage, dummy_block: int, backend: Backend,
                 buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> None:
        """dummy_block: a block of `kv` no sequence ever owns (padding rows write there)."""
        if not can_compile(model, backend, kv.keys[0].dtype):
            raise ValueError(f"no compiled decode step for this model on backend {backend!r}")
        self.model, self.kv, self.dummy_block, self.backend = model, kv, dummy_block, backend
        self.buckets = tuple(sorted(buckets))
        self.compile_seconds: dict[tuple[int, int], float] = {}  # (batch, context bucket) -> first call's time
        self.failed: str | None = None  # why compiling failed (then every step runs eagerly)
        # One compiled callable; dynamo keeps one graph per input shape under it (dynamic=False: a
        # new shape is a new specialised graph, never a silently dynamic one).
        self._step = torch.compile(self._decode, dynamic=False, fullgraph=True)
        self._limit = max(8, len(self.buckets) * CONTEXT_BUCKETS)

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        return decode_logits(self.model, self.kv, self.backend == "native", input_ids, positions, slot_mapping,
                             block_tables, context_lens)

    @property
    def num_variants(self) -> int:
        """Compiled graphs so far: one per (batch bucket, context bucket) used."""
        return len(self.compile_seconds)

    def run(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
            logit_rows: torch.Tensor) -> torch.Tensor | None:
        """Logits [len(logit_rows), V] of an all-decode step, or None: run it eagerly."""
        bucket = batch_bucket(meta.num_seqs, self.buckets)
        if self.failed is not None or bucket is None or meta.num_decodes != meta.num_seqs:
            return None
        ctx = context_bucket(meta.max_context_len)
        padded = pad_decode_batch(input_ids, meta, bucket, self.dummy_block, self.backend)
        logits = self._call(bucket, ctx, padded.input_ids, padded.meta)
        return None if logits is None else logits[: meta.num_seqs][logit_rows]

    def warm_up(self, bucket: int, max_context: int) -> float:
        """Compile the graph of (bucket, context bucket of max_context) on an all-dummy batch; its
        seconds (0 when it was compiled already)."""
        before = self.compile_seconds.get((bucket, context_bucket(max_context)))
        tables = torch.full((bucket, 1), self.dummy_block, dtype=torch.int32, device=self.model.device)
        meta = PagedAttentionMetadata.from_tables([1] * bucket, [1] * bucket, tables, self.kv.block_size, self.backend)
        meta.context_lens_list = [max_context] * bucket  # picks the context bucket; tensors stay at 1
        ids = torch.zeros(bucket, dtype=torch.long, device=self.model.device)
        self._call(bucket, context_bucket(max_context), ids, meta)
        return 0.0 if before is not None else self.compile_seconds.get((bucket, context_bucket(max_context)), 0.0)

    def _call(self, bucket: int, ctx: int, input_ids: torch.Tensor,
              meta: PagedAttentionMetadata) -> torch.Tensor | None:
        width = ctx // self.kv.block_size
        tables = torch.full((bucket, width), self.dummy_block, dtype=torch.int32, device=input_ids.device)
        used = min(width, meta.block_tables.shape[1])  # columns past the context bucket are never read
        tables[:, :used] = meta.block_tables[:, :used]
        self.model.rotary.reserve(ctx, input_ids.device)
        key = (bucket, ctx)
        first = key not in self.compile_seconds
        start = time.perf_counter()
        try:
            # The limit counts graphs per compiled function: ours holds one per bucket key by design.
            # decode_step(): quantized matmuls take x as a decode step does (kept in the graph when traced)
            with torch._dynamo.config.patch(recompile_limit=self._limit), torch.inference_mode(), \
                    quantized_cpu.decode_step():
                logits = self._step(input_ids, meta.positions, meta.slot_mapping, tables, meta.context_lens)
        except Exception as exc:  # eager from now on; a partial step is redone (its K/V writes are idempotent)
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("compiled decode step unavailable (bucket %d, context %d), running eagerly: %s",
                        bucket, ctx, self.failed)
            return None
        if first:
            self.compile_seconds[key] = time.perf_counter() - start
            log.info("compiled the decode step for batch bucket %d, context bucket %d in %.1f s",
                     bucket, ctx, self.compile_seconds[key])
        return logits
