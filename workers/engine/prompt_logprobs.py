"""Prompt log-probabilities (`SamplingParams.prompt_logprobs` = k): for every prompt token after
the first, the model's log-probability of it given the tokens before it, and the top k tokens at
its position, as evaluation harnesses ask for them (`echo` + `logprobs` on /v1/completions).

Where they come from: the logits at prompt position p predict prompt token p + 1. The step that
computes a prefill chunk [c, e) of such a sequence keeps the hidden states of its positions
c .. min(e, prompt_len - 1) - 1 and reduces them here to the wanted values, SLICE_ROWS rows at a
time: a whole chunk's logits would be [chunk, V] fp32 (1024 x 49152 = 200 MB), a slice's are a
bounded [SLICE_ROWS, V]. The last prompt position's logits are the ones the sequence samples its
first token from (the runner's usual row), not a prompt logprob.

Recompute, not store: a sequence that still needs prompt logprobs (`Sequence.needs_prompt_logprobs`)
takes no prefix-cache hit at admission (the scheduler gives it an empty table): cached K/V holds no
logits, so every prompt position is computed again. Its blocks stay its own while it runs and go
to the tree when it leaves (finish or preemption), for later requests: committed while it runs,
they would hang below cached blocks of the same prefix that it does not hold, blocks the pool
counts as evictable and cannot evict (measured: a lone sequence then could not grow). A sequence preempted before its prompt logprobs are complete drops them and starts
over (it recomputes from position 0 anyway); once complete they are kept, and a re-admission may
hit the cache like any other. Storing logprobs beside cached blocks was declined: it would cost
(1 + k) pairs per cached token for every request, for the few that ask.

Under bf16 weights the logits are the model's (`LlamaForCausalLM.logits`: the top 64 of each
row are exact fp32, the rest bf16-rounded).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from workers.engine.request import Sequence
from workers.models.llama import LlamaForCausalLM

SLICE_ROWS = 256
"""Prompt positions whose logits exist at once: [256, V] fp32 is 48 MiB at V = 49152."""


@dataclass(frozen=True)
class PromptSpan:
    """The prompt positions of one sequence in a step whose next token's logprob is wanted."""

    seq: Sequence
    flat_start: int  # the step's flat token index of the first such position
    targets: list[int]  # the prompt tokens they predict: prompt_ids[p + 1] for each position p


@dataclass(frozen=True)
class PromptLogprobs:
    """What one step computed for one sequence: the logprobs of `len(logprobs)` more prompt tokens."""

    seq: Sequence
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per position, its top k (k = params.prompt_logprobs; [] for 0)


def prompt_spans(seqs: Seq[Sequence], num_new: Seq[int]) -> list[PromptSpan]:
    """The spans of a step that computes `num_new[i]` tokens of `seqs[i]` (flat, in this order)."""
    spans: list[PromptSpan] = []
    flat = 0
    for seq, n in zip(seqs, num_new, strict=True):
        start, done = seq.computed_len, len(seq.prompt_logprobs)
        if seq.params.prompt_logprobs is not None and start < seq.prompt_len - 1:
            # the scheduler gives such a sequence no cache hit, so it never skips a position it needs
            assert start <= done, f"prompt logprobs missing for positions {done}..{start - 1}"
            end = min(start + n, seq.prompt_len - 1)
            if start == done and end > start:
                spans.append(PromptSpan(seq, flat, seq.prompt_ids[start + 1 : end + 1]))
        flat += n
    return spans


@torch.inference_mode()
def compute(model: LlamaForCausalLM, hidden: torch.Tensor, spans: Seq[PromptSpan]) -> list[PromptLogprobs]:
    """Reduce the step's hidden states [N, H] at the spans' positions to their prompt logprobs."""
    device = hidden.device
    rows = torch.cat([torch.arange(s.flat_start, s.flat_start + len(s.targets), device=device) for s in spans])
    targets = torch.tensor([t for s in spans for t in s.targets], dtype=torch.long, device=device)
    k = max(s.seq.params.prompt_logprobs or 0 for s in spans)
    chosen: list[torch.Tensor] = []
    top_values: list[torch.Tensor] = []
    top_ids: list[torch.Tensor] = []
    for start in range(0, rows.shape[0], SLICE_ROWS):
        logprobs = model.logits(hidden[rows[start : start + SLICE_ROWS]]).log_softmax(dim=-1)
        chosen.append(logprobs.gather(1, targets[start : start + SLICE_ROWS, None])[:, 0])
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
        del logprobs  # one slice of logits alive at a time
    chosen_list = torch.cat(chosen).tolist()
    values_list = torch.cat(top_values).tolist() if k else []
    ids_list = torch.cat(top_ids).tolist() if k else []
    results: list[PromptLogprobs] = []
    at = 0
    for span in spans:
        count, span_k = len(span.targets), span.seq.params.prompt_logprobs or 0
        top = [list(zip(ids_list[i][:span_k], values_list[i][:span_k], strict=True)) if span_k else []
               for i in range(at, at + count)]
        results.append(PromptLogprobs(span.seq, chosen_list[at : at + count], top))
        at += count
    return results
