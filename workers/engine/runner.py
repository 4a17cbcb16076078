"""Runs a scheduled batch through the model: block copies, the step's metadata (on the engine's
attention backend), one forward, the logits of the sequences that sample, and the prompt
logprobs of the prefill chunks that ask for them (workers/engine/prompt_logprobs.py).

The step's block tables come from persistent rows (`table_rows.BlockTableRows`) updated only where a
table changed; positions and slots are tensor ops over them (`PagedAttentionMetadata.from_tables`):
the Python work per step is O(batch).

A step that verifies speculative drafts while every sequence decodes runs as one-token rows
(workers/engine/decode_rows.py) when the model's fused decode step takes them: verifying k drafted
tokens then costs a decode step over k + 1 rows, not an eager extend step."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cache.kv_storage import KVStorage
from kernels.metadata import Backend, PagedAttentionMetadata, to_device
from kernels.quantized import cpu as quantized_cpu
from workers.engine import decode_rows, prompt_logprobs
from workers.engine.batch import ScheduledBatch
from workers.engine.prompt_logprobs import PromptLogprobs
from workers.engine.request import PENDING_TOKEN, Sequence
from workers.engine.table_rows import BlockTableRows
from workers.models import fused_decode
from workers.models.llama import LlamaForCausalLM


class PendingTokens(Protocol):
    """Tokens an overlapped step sampled that the host has not read (workers/engine/overlap.py): each
    sequence's row in `tokens` (int64, on the model's device); its ids end with PENDING_TOKEN meanwhile."""

    @property
    def rows(self) -> Mapping[Sequence, int]: ...

    @property
    def tokens(self) -> torch.Tensor: ...


class BucketedDecode(Protocol):
    """Decode steps run by batch bucket: captured CUDA graphs (cuda_graphs.py) or a compiled step
    (compiled_decode.py). run -> the logits of `logit_rows`, or None: run this step eagerly."""

    def run(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata,
            logit_rows: torch.Tensor) -> torch.Tensor | None: ...


@dataclass
class StepOutput:
    logits: torch.Tensor  # fp32 [len(batch.sampling), V]: the sampling sequences' rows, in batch order
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # this step's, per asking sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVStorage, backend: Backend | None = None,
                 graphs: BucketedDecode | None = None) -> None:
        self.model, self.kv = model, kv
        self.backend = backend  # the attention backend of every step; None: by device
        self.table_rows = BlockTableRows(model.device)
        self.graphs = graphs  # decode steps by batch bucket (CUDA graphs or compiled); None: every step eager
        self.fused_verifications = 0  # steps that verified drafts as fused decode rows (tests, benches)

    def run(self, batch: ScheduledBatch, pending: PendingTokens | None = None) -> StepOutput:
        """Compute the batch's new tokens; returns the fp32 logits [len(batch.sampling), V] of the
        sequences that reach their newest token (they sample next), in batch order, and the prompt
        logprobs of the prompt positions computed in this step by sequences that ask for them. A
        sequence with a speculative draft of k tokens has k + 1 consecutive rows (its newest token's,
        then each draft token's). A newest token still PENDING_TOKEN is read from `pending` on the device."""
        self.kv.copy_blocks(batch.block_copies)
        tokens: list[int] = []
        context_lens, tables, sampling_rows = [], [], []
        fill_at, fill_from = [], []  # flat indices of pending tokens, and their rows in pending.tokens
        for row, (seq, n, samples, draft) in enumerate(zip(batch.seqs, batch.num_new, batch.samples, batch.drafts,
                                                           strict=True)):
            end = seq.computed_len + n
            if draft:
                tokens.extend((seq.all_ids + draft)[seq.computed_len : end])
            else:
                tokens.extend(seq.ids_between(seq.computed_len, end))
            if end == seq.total_len and seq.output_ids and seq.output_ids[-1] == PENDING_TOKEN:
                if pending is None:
                    raise RuntimeError("a pending token reached a step that has no pending tokens")
                fill_at.append(len(tokens) - 1)
                fill_from.append(pending.rows[seq])
            context_lens.append(end)
            assert seq.block_table is not None
            tables.append(seq.block_table)
            if samples:
                sampling_rows.append(row)
        device = self.model.device
        meta: PagedAttentionMetadata | None
        if len(tokens) == len(tables) and self.kv.layout.num_groups == 1:  # every sequence decodes one token
            meta = self.table_rows.decode_metadata([table.groups[0] for table in tables], context_lens,
                                                   self.kv.block_size, self.backend)
        else:
            block_tables = self.table_rows.gather([table.groups[0] for table in tables])
            meta = self._decode_rows(batch, block_tables) if batch.has_drafts else None
            if meta is None:
                meta = PagedAttentionMetadata.from_tables(batch.num_new, context_lens, block_tables,
                                                          self.kv.block_size, backend=self.backend)
        for group in range(1, self.kv.layout.num_groups):  # the other layer groups' pages
            meta.other_groups.append(meta.with_tables(self.table_rows.gather([t.groups[group] for t in tables])))
        wanted: torch.Tensor | None
        if batch.has_drafts:  # the flat token order is the same with or without decode rows
            wanted = _draft_rows(batch, sampling_rows, device)
        elif len(sampling_rows) == len(tokens) and self.graphs is None:
            wanted = None  # one token per sequence, every one sampling: all the rows, in order (no gather)
        else:
            last_token = (meta.query_start[1:] - 1).long()
            wanted = last_token[to_device(sampling_rows, torch.long, device)]
        input_ids = to_device(tokens, torch.long, device)
        if fill_at:  # on the device, in stream order after the step that sampled them: no wait here
            assert pending is not None
            at, rows = (to_device(i, torch.long, device) for i in (fill_at, fill_from))
            input_ids[at] = pending.tokens[rows]
        spans = prompt_logprobs.prompt_spans(batch.seqs, batch.num_new)
        if spans:  # the hidden states of every prompt position asked for, reduced slice by slice
            hidden = self.model.hidden_states(input_ids, self.kv, meta)
            with torch.inference_mode():
                logits = self.model.logits(hidden if wanted is None else hidden[wanted])
            return StepOutput(logits, prompt_logprobs.compute(self.model, hidden, spans))
        if self.graphs is not None:
            assert wanted is not None
            graph_logits = self.graphs.run(input_ids, meta, wanted)
            if graph_logits is not None:
                return StepOutput(graph_logits)
        # A step with no prefill may round quantized matmuls' inputs to int8 (kernels/quantized/cpu.py)
        with quantized_cpu.decode_step() if decode_rows.all_decoding(batch.num_new, batch.drafts) else nullcontext():
            return StepOutput(self.model(input_ids, self.kv, meta, wanted))  # [0, V] when only partial prefills ran

    def _decode_rows(self, batch: ScheduledBatch, block_tables: torch.Tensor) -> PagedAttentionMetadata | None:
        """A verification step as one-token decode rows, when every sequence decodes and the model's
        fused decode step takes the rows; None: the step runs extend-style."""
        if not decode_rows.all_decoding(batch.num_new, batch.drafts) or self.kv.layout.num_groups > 1:
            return None
        meta = decode_rows.expand(batch.num_new, [seq.computed_len for seq in batch.seqs], block_tables,
                                  self.kv.block_size, self.backend)
        if not fused_decode.can_fuse(self.model, meta, self.kv.keys[0].dtype):
            return None
        self.fused_verifications += 1
        return meta


def _draft_rows(batch: ScheduledBatch, sampling_rows: list[int], device: torch.device) -> torch.Tensor:
    """Token indices whose logits a step with drafts returns: each sampling sequence's last
    1 + len(draft) tokens (the last one alone without a draft), in batch order."""
    starts, total = [], 0
    for n in batch.num_new:
        starts.append(total)
        total += n
    wanted: list[int] = []
    for row in sampling_rows:
        end = starts[row] + batch.num_new[row]
        wanted.extend(range(end - 1 - len(batch.drafts[row]), end))
    return torch.tensor(wanted, dtype=torch.long, device=device)
