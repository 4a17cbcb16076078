"""Runs a scheduled batch through the model: block copies, the step's metadata (on the engine's
attention backend), one forward, the logits of the sequences that sample, and the prompt
logprobs of the prefill chunks that ask for them (workers/engine/prompt_logprobs.py).

The step's block tables come from persistent rows (`table_rows.BlockTableRows`) updated only where a
table changed; positions and slots are tensor ops over them (`PagedAttentionMetadata.from_tables`):
the Python work per step is O(batch)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cache.kv_storage import KVStorage
from kernels.metadata import Backend, PagedAttentionMetadata
from workers.engine import prompt_logprobs
from workers.engine.batch import ScheduledBatch
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.prompt_logprobs import PromptLogprobs
from workers.engine.table_rows import BlockTableRows
from workers.models.llama import LlamaForCausalLM


@dataclass
class StepOutput:
    logits: torch.Tensor  # fp32 [len(batch.sampling), V]: the sampling sequences' rows, in batch order
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # this step's, per asking sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVStorage, backend: Backend | None = None,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model, self.kv = model, kv
        self.backend = backend  # the attention backend of every step; None: by device
        self.table_rows = BlockTableRows(model.device)
        self.graphs = graphs  # captured decode steps (CUDA only); None: every step eager

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Compute the batch's new tokens; returns the fp32 logits [len(batch.sampling), V] of the
        sequences that reach their newest token (they sample next), in batch order, and the prompt
        logprobs of the prompt positions computed in this step by sequences that ask for them. A
        sequence with a speculative draft of k tokens has k + 1 consecutive rows (its newest token's,
        then each draft token's)."""
        self.kv.copy_blocks(batch.block_copies)
        tokens: list[int] = []
        context_lens, tables, sampling_rows = [], [], []
        for row, (seq, n, samples, draft) in enumerate(zip(batch.seqs, batch.num_new, batch.samples, batch.drafts,
                                                           strict=True)):
            end = seq.computed_len + n
            tokens.extend((seq.all_ids + draft if draft else seq.all_ids)[seq.computed_len : end])
            context_lens.append(end)
            assert seq.block_table is not None
            tables.append(seq.block_table)
            if samples:
                sampling_rows.append(row)
        device = self.model.device
        meta = PagedAttentionMetadata.from_tables(batch.num_new, context_lens, self.table_rows.gather(tables),
                                                  self.kv.block_size, backend=self.backend)
        last_token = (meta.query_start[1:] - 1).long()
        if batch.has_drafts:
            wanted = _draft_rows(batch, sampling_rows, device)
        else:
            wanted = last_token[torch.tensor(sampling_rows, dtype=torch.long, device=device)]
        input_ids = torch.tensor(tokens, dtype=torch.long, device=device)
        spans = prompt_logprobs.prompt_spans(batch.seqs, batch.num_new)
        if spans:  # the hidden states of every prompt position asked for, reduced slice by slice
            hidden = self.model.hidden_states(input_ids, self.kv, meta)
            with torch.inference_mode():
                logits = self.model.logits(hidden[wanted])
            return StepOutput(logits, prompt_logprobs.compute(self.model, hidden, spans))
        if self.graphs is not None:
            graph_logits = self.graphs.run(input_ids, meta, wanted)
            if graph_logits is not None:
                return StepOutput(graph_logits)
        return StepOutput(self.model(input_ids, self.kv, meta, wanted))  # [0, V] when only partial prefills ran


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
