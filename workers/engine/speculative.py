"""Speculative decoding's engine side: who drafts this step (`propose_drafts`), verifying drafts
exactly (`verify`), and emitting the verified tokens through the engine's stop checks
(`emit_verified`).

A decoding sequence with a draft t1..tk runs k + 1 tokens in the batched step (its newest token,
then the draft: extend-style attention over those positions on its paged KV), and the model's
logits at all k + 1 positions come back. Verification walks them in order:
- greedy: accept t_i while it is the argmax of position i; the first mismatch's argmax (or, all
  accepted, the last position's argmax, the bonus token) ends it. The tokens are exactly those of
  one-token decoding.
- sampled: the target p_i is the sampler's distribution (temperature, top-k/p, min-p). A draft is
  a point mass q, so rejection sampling accepts t_i with probability min(1, p_i(t_i) / 1) and on a
  rejection draws from the residual max(0, p_i - q) normalized: p_i with t_i removed. All accepted,
  the bonus is drawn from p_k. Each output token is then distributed exactly as p; the draws use
  the sequence's own generator, so a seed reproduces.
Requests whose tokens depend on more than the logits (penalties over the output, logprobs,
grammar masks) do not speculate: they decode one token per step exactly as without it.

Adaptive: each sequence keeps an acceptance rate (exponential moving average); below `MIN_RATE`
it stops drafting for a cool-down that doubles on each further miss, and nobody drafts while more
than `max_batch` sequences decode (a large batch is compute-bound: verifying rejected drafts costs
real time there). Below that, a governor measuring the steps' cost with and without drafts keeps
drafting off where it loses (workers/engine/spec_governor.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.engine.batch import Fork, StepUpdate
from workers.engine.deltas import Delta
from workers.engine.drafter import Drafter
from workers.engine.request import Sequence, Status
from workers.engine.sampler import truncate
from workers.engine.scheduler import Scheduler
from workers.engine.spec_governor import SpeculationGovernor

EMA = 0.3  # weight of the newest step in a sequence's acceptance rate
MIN_RATE = 0.25  # below this a sequence pauses drafting
MAX_COOLDOWN = 64  # steps


@dataclass
class SpecStats:
    """Counters since start (the worker's /metrics)."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0  # sequence-steps that verified a draft

    def as_dict(self) -> dict[str, float | int]:
        rate = self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        mean = self.accepted_tokens / self.verifications if self.verifications else 0.0
        return {"drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "verifications": self.verifications, "acceptance_rate": rate, "mean_accepted_length": mean}


def eligible(seq: Sequence) -> bool:
    """Whether a sequence's tokens depend only on the logits (what verification reproduces exactly)."""
    params = seq.params
    return seq.matcher is None and params.logprobs is None and not params.penalized


def draft_budget(seq: Sequence, k: int, max_context: int) -> int:
    """Draft tokens worth proposing: accepted ones plus the bonus stay within max_tokens and the context."""
    return max(0, min(k, seq.params.max_tokens - seq.output_len - 1, max_context - seq.total_len - 1))


def wants_draft(seq: Sequence) -> bool:
    """Counts down a paused sequence's cool-down; True when it may draft this step."""
    if seq.spec_cooldown > 0:
        seq.spec_cooldown -= 1
        return False
    return True


def propose_drafts(running: list[Sequence], drafter: Drafter, k: int, max_batch: int, max_context: int,
                   governor: SpeculationGovernor | None = None) -> None:
    """Each decoding sequence's draft for the coming step (the scheduler takes it or drops it).
    With a `governor`, the sequences it governs draft only in steps it allows."""
    decoding = [s for s in running
                if s.status is Status.RUNNING and s.output_len > 0 and s.computed_len == s.total_len - 1]
    crowded = len(decoding) > max_batch
    timed_off = governor is not None and not crowded and not governor.allows(len(decoding))
    for seq in decoding:
        off = crowded or not eligible(seq) or (timed_off and SpeculationGovernor.governs(seq))
        budget = 0 if off else draft_budget(seq, k, max_context)
        seq.draft_ids = drafter.propose(seq.all_ids, budget, seq) if budget and wants_draft(seq) else []


def record(seq: Sequence, drafted: int, accepted: int) -> None:
    """Update the sequence's acceptance rate; pause it when the rate is low."""
    seq.spec_rate = (1 - EMA) * seq.spec_rate + EMA * (accepted / drafted)
    if seq.spec_rate < MIN_RATE:
        seq.spec_backoff = min(max(2 * seq.spec_backoff, 2), MAX_COOLDOWN)
        seq.spec_cooldown = seq.spec_backoff
        seq.spec_rate = MIN_RATE  # one good step after the pause lifts it back above
    elif accepted == drafted:
        seq.spec_backoff = 0


def verify(rows: torch.Tensor, draft: list[int], seq: Sequence) -> list[int]:
    """The tokens a drafted sequence emits this step: its accepted draft prefix, then one more
    (the correction or the bonus). `rows`: fp32 logits [len(draft) + 1, V] at its k + 1 positions."""
    params = seq.params
    if params.greedy:
        best = rows.argmax(dim=-1).tolist()
        out = []
        for i, token in enumerate(draft):
            if best[i] != token:
                break
            out.append(token)
        out.append(best[len(out)])
        return out
    scaled = rows / params.temperature
    if params.truncates:
        scaled = truncate(scaled, [seq] * rows.shape[0])
    probs = scaled.softmax(dim=-1)
    gen = seq.generator
    uniforms = torch.rand(len(draft), generator=gen, device=rows.device).tolist() if draft else []
    draft_probs = probs[torch.arange(len(draft), device=rows.device),
                        torch.tensor(draft, dtype=torch.long, device=rows.device)].tolist() if draft else []
    out = []
    for i, token in enumerate(draft):
        if uniforms[i] < draft_probs[i]:
            out.append(token)
            continue
        residual = probs[i].clone()
        residual[token] = 0.0  # p with the rejected point mass removed (normalizing does not change the argmax race)
        out.append(_draw(residual, gen))
        return out
    out.append(_draw(probs[len(draft)], gen))
    return out


def emit_verified(seq: Sequence, rows: torch.Tensor, draft: list[int], now: float,
                  emit: Callable[[Sequence, int, Delta, float], Delta], scheduler: Scheduler,
                  stats: SpecStats) -> Delta:
    """Emit a drafted sequence's verified tokens one by one through the engine's `emit` (each with
    the stop checks), then settle its KV: accepted slots kept, the rest rolled back."""
    tokens = verify(rows, draft, seq)
    accepted = len(tokens) - 1
    stats.drafted_tokens += len(draft)
    stats.accepted_tokens += accepted
    stats.verifications += 1
    seq.spec_drafted += len(draft)
    seq.spec_accepted += accepted
    record(seq, len(draft), accepted)
    merged = Delta(seq.request_id, index=seq.index)
    for token in tokens:
        delta = emit(seq, token, Delta(seq.request_id, [token], index=seq.index), now)
        merged.token_ids += delta.token_ids
        merged.text += delta.text
        merged.finish_reason, merged.usage, merged.speculative = delta.finish_reason, delta.usage, delta.speculative
        if seq.finished:
            break
    scheduler.vtc.charge(seq.namespace, output_tokens=accepted)  # the step charged one token
    if not seq.finished:
        scheduler.settle_draft(seq, accepted)
    return merged


def split_drafted(update: StepUpdate, logits: torch.Tensor, drafts: list[list[int]],
                  ) -> tuple[StepUpdate, torch.Tensor, list[tuple[Sequence, torch.Tensor, list[int]]]]:
    """Split a step with drafts: the plain sampling sequences with their one row each (forks'
    rows renumbered), and each drafted sequence with its k + 1 rows."""
    keep: list[int] = []
    last_rows: list[int] = []
    drafted = []
    start = 0
    for i, (seq, draft) in enumerate(zip(update.sampling, drafts, strict=True)):
        end = start + 1 + len(draft)
        if draft:
            drafted.append((seq, logits[start:end], draft))
        else:
            keep.append(i)
            last_rows.append(end - 1)
        start = end
    renumber = {old: new for new, old in enumerate(keep)}
    forks = [Fork(f.parent, f.child, renumber[f.row]) for f in update.forks]
    return StepUpdate([update.sampling[i] for i in keep], forks), logits[last_rows], drafted


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One draw from (unnormalized) probs: the exponential race, as the sampler draws."""
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int((probs / noise).argmax())
