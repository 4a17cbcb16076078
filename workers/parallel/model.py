"""The sharded Llama model: rank 0 (the leader) runs the engine, the other ranks (followers) mirror
each of its model calls on their shards.

Ownership: the leader's engine alone schedules, allocates blocks (block ids are the same on every
rank: the KV layout is identical, only the heads differ), keeps the prefix cache and samples. Every
model call the engine makes on the leader (`allocate_kv`, the KV storage's `copy_blocks`,
`hidden_states`, `logits`, `forward`) is first announced to the followers (`broadcast_object_list`
from rank 0: the call and what it needs — token ids, the step's lengths and block tables, block
copies, hidden rows), then run on every rank, whose collectives (all_reduce, all_gather) meet in the
same order. Followers run `serve` until the leader announces `stop`. Every rank ends up with the
full fp32 logits; only the leader's are used. On CUDA with `EngineConfig.cuda_graphs`, a decode step
run as a CUDA graph is announced once as `graphed` (before its capture or replay, not the calls
inside it), and each follower runs the same bucket in its own graphs (workers/engine/cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cache.kv_layout import KVLayout
from cache.kv_storage import KVStorage
from kernels.metadata import PagedAttentionMetadata
from workers.models.llama import LlamaForCausalLM
from workers.models.logits_refine import REFINED_TOP
from workers.parallel.layers import TensorParallelGroup, check_tensor_parallel, shard_layers, vocab_shard

if TYPE_CHECKING:
    from workers.engine.cuda_graphs import DecodeGraphs


class ShardedLlamaForCausalLM(LlamaForCausalLM):
    """A LlamaForCausalLM whose layers hold one rank's shard (workers/parallel/layers.py). Built by
    `shard` from a loaded model; `config` stays the whole model's."""

    fused_decode_ok = False  # the native fused decode step has no collectives: layers run one by one
    # CUDA graphs per rank: a graphed step is announced once, before its capture or replay, and every
    # rank runs its own graph of its shard (workers/engine/cuda_graphs.py); inside, nothing is announced.
    cuda_graphs_ok = True
    tp: TensorParallelGroup
    _quiet = False  # True within `unannounced` (the leader's captured step's body)

    @property
    def is_leader(self) -> bool:
        return self.tp.rank == 0

    def _announce(self, *message: Any) -> None:
        if self.is_leader and not self._quiet:
            dist.broadcast_object_list([message], src=0, group=self.tp.group)

    def announce_captured_step(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, dummy_block: int) -> None:
        self._announce("graphed", *_step_message(input_ids, meta), dummy_block)

    @contextmanager
    def unannounced(self) -> Iterator[None]:
        quiet, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = quiet

    # -- the engine's calls (announced by the leader) -------------------------------------------
    def allocate_kv(self, num_blocks: int, block_size: int = 16, dtype: torch.dtype | None = None,
                    layout: KVLayout | None = None) -> KVStorage:
        if layout is not None and layout.num_groups > 1:  # only Llama layers shard: one window for all
            raise ValueError("a sharded model keeps one block table for all its layers")
        self._announce("kv", num_blocks, block_size, dtype)
        c = self.config
        cls = AnnouncedKVStorage if self.is_leader else KVStorage
        kv = cls(c.num_layers, num_blocks, block_size, c.num_kv_heads // self.tp.size, c.head_dim,
                 dtype or self.dtype, self.device)
        if isinstance(kv, AnnouncedKVStorage):
            kv.model = self
        return kv

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, kv: KVStorage, meta: PagedAttentionMetadata,
                logit_indices: torch.Tensor | None = None) -> torch.Tensor:
        self._announce("forward", *_step_message(input_ids, meta),
                       None if logit_indices is None else _owned(logit_indices))
        hidden = self._hidden(input_ids, kv, meta)
        return self._logits(hidden if logit_indices is None else hidden[logit_indices])

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, kv: KVStorage, meta: PagedAttentionMetadata) -> torch.Tensor:
        self._announce("hidden", *_step_message(input_ids, meta))
        return self._hidden(input_ids, kv, meta)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._announce("logits", _owned(hidden))
        return self._logits(hidden)

    def stop_followers(self) -> None:
        self._announce("stop")

    # -- every rank's share ---------------------------------------------------------------------
    def _hidden(self, input_ids: torch.Tensor, kv: KVStorage, meta: PagedAttentionMetadata) -> torch.Tensor:
        return LlamaForCausalLM.hidden_states(self, input_ids, kv, meta)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full fp32 logits [n, V] on every rank: each rank's vocabulary columns, gathered. In bf16 the
        REFINED_TOP largest of each row are recomputed in fp32 as LlamaForCausalLM.logits does, each
        rank computing those of its own columns (the others add zeros)."""
        vocab = self.config.vocab_size
        if hidden.shape[0] == 0:  # every rank knows the row count: none joins a collective
            return hidden.new_zeros(0, vocab, dtype=torch.float32)
        local = self.lm_head(self.norm(hidden)).float()
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.all_gather(parts, local, group=self.tp.group)
        logits = torch.cat(parts, dim=-1)[:, :vocab].contiguous()
        if self.dtype == torch.float32:
            return logits
        exact_normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=self.norm.eps) * self.norm.weight.float()
        top = logits.topk(min(REFINED_TOP, vocab), dim=-1).indices  # the same on every rank
        start, end, per = vocab_shard(vocab, self.tp)
        local_top = top - start
        owned = (local_top >= 0) & (local_top < end - start)
        rows = self.lm_head.weight[local_top.clamp(0, per - 1)].float()  # [n, k, H]
        exact = torch.einsum("nkh,nh->nk", rows, exact_normed) * owned
        dist.all_reduce(exact, group=self.tp.group)
        return logits.scatter_(1, top, exact)

    # -- followers ------------------------------------------------------------------------------
    @torch.inference_mode()
    def serve(self) -> None:
        """A follower's loop: run every call the leader announces until it announces `stop`."""
        assert not self.is_leader
        kv: KVStorage | None = None
        graphs: DecodeGraphs | None = None  # this rank's captured decode steps, made at the first one
        device = self.device
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.tp.group)
            kind, *args = box[0]
            if kind == "stop":
                return
            if kind == "kv":
                kv = self.allocate_kv(*args)
            elif kind == "copy":
                assert kv is not None
                kv.copy_blocks(args[0])
            elif kind == "logits":
                self._logits(args[0].to(device))
            elif kind == "graphed":  # the leader's captured step: the same bucket in this rank's graphs
                assert kv is not None
                ids, meta = _rebuilt_step(args, device)
                if graphs is None:
                    from workers.engine.cuda_graphs import DecodeGraphs  # CUDA only: loaded when used

                    assert meta.backend is not None  # a graphed step's metadata names its backend
                    graphs = DecodeGraphs(self, kv, args[6], meta.backend)
                graphs.run(ids, meta, torch.arange(meta.num_seqs, device=device))
            else:  # hidden / forward: rebuild the step's metadata from its lengths and tables
                assert kv is not None
                ids, meta = _rebuilt_step(args, device)
                hidden = self._hidden(ids, kv, meta)
                if kind == "forward":
                    wanted = args[6]
                    self._logits(hidden if wanted is None else hidden[wanted.to(device)])


class AnnouncedKVStorage(KVStorage):
    """The leader's KV storage: block copies (copy-on-write of forked choices) are announced first."""

    model: ShardedLlamaForCausalLM

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if copies:
            self.model._announce("copy", list(copies))
        super().copy_blocks(copies)


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of exactly `tensor`'s elements (pickling a view would send its whole storage)."""
    return tensor.detach().to("cpu", copy=True)


def _step_message(input_ids: torch.Tensor, meta: PagedAttentionMetadata) -> tuple[Any, ...]:
    """What a follower needs to rebuild the step: its token ids and the metadata's inputs (CPU)."""
    return (_owned(input_ids), meta.query_lens_list, meta.context_lens_list, _owned(meta.block_tables),
            meta.block_size, meta.backend)


def _rebuilt_step(message: Sequence[Any], device: torch.device) -> tuple[torch.Tensor, PagedAttentionMetadata]:
    """A follower's copy of a step announced with `_step_message`: token ids and metadata on `device`."""
    ids, q_lens, ctx_lens, tables, block_size, step_backend = message[:6]
    meta = PagedAttentionMetadata.from_tables(q_lens, ctx_lens, tables.to(device), block_size, step_backend)
    return ids.to(device), meta


def shard(model: LlamaForCausalLM, tp: TensorParallelGroup) -> ShardedLlamaForCausalLM:
    """This rank's shard of a loaded Llama-family model (the same object, its class changed)."""
    if type(model) is not LlamaForCausalLM:
        raise TypeError(f"{type(model).__name__} cannot be sharded; only the plain Llama layers can")
    check_tensor_parallel(model.config, tp.size)
    shard_layers(model, tp)
    model.__class__ = ShardedLlamaForCausalLM
    assert isinstance(model, ShardedLlamaForCausalLM)
    model.tp = tp
    return model
