"""Batched sampling: penalties -> temperature -> top-k -> top-p -> min-p -> draw.

Every stage is a tensor op over the rows that need it; no Python loop touches the vocabulary.
Draws use the exponential race (argmax of p / E with E ~ Exp(1)), with each row's noise from its
own generator: a seeded request draws the same tokens whatever else is in the batch.
Log-probabilities are those of the model (raw logits), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from kernels.cpu import native
from kernels.metadata import to_device
from workers.engine.request import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None = None  # of each chosen token, when any row asked
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per row, its top k (k = params.logprobs)


def apply_penalties(logits: torch.Tensor, seqs: Seq[Sequence]) -> None:
    """In place. Repetition penalty over prompt + output (divide positive logits, multiply negative);
    frequency / presence over the output, OpenAI style."""
    rows = [i for i, s in enumerate(seqs) if s.params.penalized]
    if not rows:
        return
    device = logits.device
    vocab = logits.shape[1]
    for_rows = [seqs[i] for i in rows]
    index = to_device(rows, torch.long, device)
    sub = logits[index]
    # token counts of each row's output, and a seen-anywhere mask for the repetition penalty
    outputs = _padded_ids([s.output_ids for s in for_rows], vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(
        1, outputs, torch.ones_like(outputs, dtype=torch.float32))[:, :vocab]
    seen_ids = _padded_ids([s.all_ids for s in for_rows], vocab, device)
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device).scatter_(
        1, seen_ids, True)[:, :vocab]
    rep = to_device([s.params.repetition_penalty for s in for_rows], torch.float32, device)[:, None]
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    freq = to_device([s.params.frequency_penalty for s in for_rows], torch.float32, device)[:, None]
    pres = to_device([s.params.presence_penalty for s in for_rows], torch.float32, device)[:, None]
    sub -= freq * counts + pres * (counts > 0).float()
    logits[index] = sub


def _padded_ids(rows: list[list[int]], fill: int, device: torch.device) -> torch.Tensor:
    """Rows of token ids as one int64 [len(rows), longest] tensor on `device`, `fill` past each row's end;
    one copy to the device (`to_device`: no wait for its queue), not one per row."""
    width = max(max(len(r) for r in rows), 1)
    flat = [t for r in rows for t in (*r, *[fill] * (width - len(r)))]
    return to_device(flat, torch.long, device).view(len(rows), width)


def truncate(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k, top-p nucleus and min-p floor, in that order."""
    device = logits.device
    vocab = logits.shape[1]
    top_k = to_device([s.params.top_k or vocab for s in seqs], torch.long, device)
    top_p = to_device([s.params.top_p for s in seqs], torch.float32, device)
    min_p = to_device([s.params.min_p for s in seqs], torch.float32, device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the better tokens; the first always stays
    sorted_logits = sorted_logits.masked_fill(before > top_p[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def exponential_noise(seqs: Seq[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
    noise = torch.empty(len(seqs), vocab, device=device)
    for row, s in enumerate(seqs):
        noise[row].exponential_(generator=s.generator)  # one call per row, over the whole vocabulary
    return noise


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row (the first where values tie). On a CPU with the native ops loaded, one
    C++ pass per row (`row_argmax`, kernels/cpu/native/head_ops.cpp): torch's `max(dim=-1)` over a
    [32, 49152] fp32 batch took 0.7 ms of a 50 ms decode step on a 2-core EPYC. Elsewhere `max`,
    whose indices are the same (torch's `argmax` took 2.5x as long as `max` on a CPU)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and native.is_loaded()):
        return torch.ops.tollway_cpu.row_argmax(logits.contiguous())
    return logits.max(dim=-1).indices


@dataclass
class DeviceSample:
    """A step's draw before the host reads it: tensors on the logits' device. The chosen tokens, and
    where any row asked for logprobs, every row's chosen logprob and its top `max(top_k)` (each row
    reports its own `top_k[row]` of them)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_k: list[int] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.token_ids, self.logprobs, self.top_ids, self.top_values) if t is not None]

    def read(self, tensors: list[torch.Tensor] | None = None) -> SampleResult:
        """The host's result, from `tensors` (host copies of `tensors()`, in order) or from these."""
        token_ids, *rest = self.tensors() if tensors is None else tensors
        result = SampleResult(token_ids.tolist())
        if rest:
            logprobs, top_ids, top_values = rest
            result.logprobs = logprobs.tolist()
            ids, values = top_ids.tolist(), top_values.tolist()
            result.top_logprobs = [list(zip(ids[r][:k], values[r][:k], strict=True)) for r, k in enumerate(self.top_k)]
        return result


def sample(logits: torch.Tensor, seqs: Seq[Sequence],
           constrain: Callable[[torch.Tensor], None] | None = None) -> SampleResult:
    """Next token for each row of fp32 logits [B, V] (not modified), one row per sequence.
    `constrain` masks (in place, -inf) the tokens each row's grammar forbids, before penalties;
    the reported log-probabilities stay the model's."""
    return draw_sample(logits, seqs, constrain).read()


def draw_sample(logits: torch.Tensor, seqs: Seq[Sequence],
                constrain: Callable[[torch.Tensor], None] | None = None) -> DeviceSample:
    """`sample` without reading anything on the host (overlapped steps read it a step later)."""
    raw_logprobs = logits.log_softmax(dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
    chosen = draw(logits, seqs, constrain)
    if raw_logprobs is None:
        return DeviceSample(chosen)
    top_k = [s.params.logprobs or 0 for s in seqs]
    top_values, top_ids = raw_logprobs.topk(max(max(top_k), 1), dim=-1)
    return DeviceSample(chosen, raw_logprobs.gather(1, chosen[:, None])[:, 0], top_ids, top_values, top_k)


def draw(logits: torch.Tensor, seqs: Seq[Sequence],
         constrain: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """The chosen token of each row, as an int64 tensor on the logits' device; nothing waits for the
    device (the index and temperature tensors go over without a sync), so an engine can schedule its
    next step while this one's tokens are still on their way (workers/engine/overlap.py)."""
    changes = constrain is not None or any(s.params.penalized for s in seqs)
    work = logits.clone() if changes else logits  # read-only below unless a grammar or a penalty writes it
    if constrain is not None:
        constrain(work)
    apply_penalties(work, seqs)
    chosen = greedy_choice(work)
    sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled_rows:
        index = to_device(sampled_rows, torch.long, logits.device)
        sub_seqs = [seqs[i] for i in sampled_rows]
        temperature = to_device([s.params.temperature for s in sub_seqs], torch.float32, logits.device)
        sub = work[index] / temperature[:, None]
        if any(s.params.truncates for s in sub_seqs):
            sub = truncate(sub, sub_seqs)
        probs = sub.softmax(dim=-1)
        noise = exponential_noise(sub_seqs, logits.shape[1], logits.device)
        chosen[index] = (probs / noise).argmax(dim=-1)
    return chosen
