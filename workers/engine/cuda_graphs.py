"""Captured decode steps on CUDA: one CUDA graph per (batch bucket, context bucket)
(graph_buckets.py), replayed with the step's inputs copied into the graph's static buffers.

On by default on CUDA (`EngineConfig.cuda_graphs`, TOLLWAY_CUDA_GRAPHS); every batch bucket is captured
at start at the first context bucket (`warm_up`), larger contexts on first use. Measured on an H200
(ops/bench/gpu_engine.py, tests/unit/kernels/test_gpu.py); the bucketing and padding are unit-tested on
the CPU too (tests/unit/workers/test_graph_buckets.py), and so is the whole protocol with `_EagerReplay`
standing in for the capture (tests/unit/workers/test_tensor_parallel.py).
Steps that are not all decodes, or hold more sequences than the largest bucket, run eagerly; so does
every step after a capture fails (a model whose step syncs with the host, say), logged once.
With layer groups (cache/kv_layout.py) every group has its own static block tables and slots.

Tensor parallel (workers/parallel/model.py): every rank keeps its own graphs of its shard. Before a
graphed step the leader announces it (`announce_captured_step`: the step's tokens, lengths, tables
and the padding block); each follower runs the same `run` on its own `DecodeGraphs`, so all ranks
capture a bucket together, their collectives recorded inside each rank's graph, and replay together.
The body of a capture or replay is `unannounced`: nothing inside a graph talks to the host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cache.kv_storage import KVStorage
from kernels.metadata import Backend, PagedAttentionMetadata
from workers.engine.graph_buckets import (
    DEFAULT_BATCH_BUCKETS,
    MIN_CONTEXT_BUCKET,
    batch_bucket,
    context_bucket,
    pad_decode_batch,
)
from workers.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class _EagerReplay:
    """A CPU stand-in for a CUDA graph, so that the capture protocol, the padding and the per-rank
    announcements run in tests on any machine: `replay` makes the captured call again. The engine
    builds `DecodeGraphs` on CUDA only (runner_setup.py); a follower rank builds one like its leader."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.replay_call = call

    def replay(self) -> None:
        self.replay_call()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | _EagerReplay
    input_ids: torch.Tensor  # [bucket]
    meta: PagedAttentionMetadata  # static tensors; context_lens_list holds the context bucket (grid size)
    logits: torch.Tensor  # [bucket, V], written by each replay


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv: KVStorage, dummy_block: int, backend: Backend,
                 buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> None:
        """dummy_block: a block of `kv` no sequence ever owns (padding rows write there)."""
        self.model, self.kv, self.dummy_block, self.backend = model, kv, dummy_block, backend
        self.buckets = tuple(buckets)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.failed: str | None = None  # why a capture failed (then every step runs eagerly)
        self.pool = torch.cuda.graph_pool_handle() if kv.keys[0].device.type == "cuda" else None
        # A graph reads the rotary tables at the addresses they had at its capture: grown later, they
        # would move and the graph would read freed memory. So they reach, now, the longest context
        # the cache can hold (or the model's limit), and are never rebuilt after.
        model.reserve_positions(min(dummy_block * kv.block_size, model.config.max_position_embeddings))

    def run(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
            logit_rows: torch.Tensor) -> torch.Tensor | None:
        """Logits [len(logit_rows), V] of an all-decode step, or None: run it eagerly."""
        bucket = batch_bucket(meta.num_seqs, self.buckets)
        if self.failed is not None or bucket is None or meta.num_decodes != meta.num_seqs:
            return None
        self.model.announce_captured_step(input_ids, meta, self.dummy_block)
        with self.model.unannounced():
            return self._run(input_ids, meta, bucket, logit_rows)

    def _run(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, bucket: int,
             logit_rows: torch.Tensor) -> torch.Tensor | None:
        ctx = context_bucket(meta.max_context_len)
        captured = self.graphs.get((bucket, ctx))
        if captured is None:
            try:
                captured = self._capture(bucket, ctx)
            except RuntimeError as exc:  # eager from now on; the step is redone (its K/V writes are idempotent)
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed (batch bucket %d), decoding eagerly: %s", bucket, self.failed)
                return None
        padded = pad_decode_batch(input_ids, meta, bucket, self.dummy_block, self.backend)
        static = captured.meta
        captured.input_ids.copy_(padded.input_ids)
        static.positions.copy_(padded.meta.positions)  # shared by every group's metadata
        static.context_lens.copy_(padded.meta.context_lens)
        for group, step in zip([static, *static.other_groups], [padded.meta, *padded.meta.other_groups], strict=True):
            group.slot_mapping.copy_(step.slot_mapping)
            width = step.block_tables.shape[1]
            group.block_tables[:, :width].copy_(step.block_tables)
            group.block_tables[:, width:] = self.dummy_block
        captured.graph.replay()
        return captured.logits[: meta.num_seqs][logit_rows]

    def warm_up(self) -> None:
        """Capture every batch bucket at the first context bucket now, at start, so that no serving
        step stalls on a capture until contexts outgrow it. Each capture goes through `run` with
        an all-padding step, so sharded models' other ranks capture with it."""
        for bucket in self.buckets:
            input_ids = torch.zeros(bucket, dtype=torch.long, device=self.model.device)
            meta = self._padding_step(bucket, MIN_CONTEXT_BUCKET)
            self.run(input_ids, meta, torch.arange(bucket, device=self.model.device))

    def _padding_step(self, bucket: int, ctx: int) -> PagedAttentionMetadata:
        """A decode step of `bucket` padding rows (one token each, in the dummy block), its block
        tables `ctx` tokens wide."""
        block_size = self.kv.block_size

        def dummy_tables() -> torch.Tensor:
            return torch.full((bucket, ctx // block_size), self.dummy_block, dtype=torch.int32, device=self.model.device)

        meta = PagedAttentionMetadata.from_tables([1] * bucket, [1] * bucket, dummy_tables(), block_size, self.backend)
        meta.other_groups = [meta.with_tables(dummy_tables()) for _ in range(1, self.kv.layout.num_groups)]
        return meta

    def _capture(self, bucket: int, ctx: int) -> _Captured:
        device = self.model.device
        meta = self._padding_step(bucket, ctx)
        meta.context_lens_list = [ctx] * bucket  # Python-side sizes (the decode grid) fixed at the bucket
        input_ids = torch.zeros(bucket, dtype=torch.long, device=device)
        if device.type != "cuda":  # the stand-in (tests): each replay runs the model on the static buffers
            logits = self.model(input_ids, self.kv, meta)

            @torch.inference_mode()
            def again() -> None:
                logits.copy_(self.model(input_ids, self.kv, meta))

            replay = _EagerReplay(again)
            captured = self.graphs[(bucket, ctx)] = _Captured(replay, input_ids, meta, logits)
            return captured
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, the rotary table reaches its size
            self.model(input_ids, self.kv, meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(input_ids, self.kv, meta)
        captured = self.graphs[(bucket, ctx)] = _Captured(graph, input_ids, meta, logits)
        return captured
