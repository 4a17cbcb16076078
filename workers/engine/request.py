"""One sequence's state in the engine, with one vocabulary of lengths.

Lengths (tokens): `prompt_len` of the prompt; `output_len` generated so far; `total_len` =
prompt + output; `cached_len` served by the prefix cache at admission (whole blocks, never the
last prompt token; 0 while prompt logprobs are still to compute); `computed_len` whose K/V is in
the sequence's blocks. Invariants: cached_len <= computed_len <= total_len, and a running
sequence is decoding once computed_len == total_len - 1 (the newest token is the next input).

Ownership: a running sequence owns one pool reference on each block of `block_table`
(including the prefix-cache blocks it locked at admission); finishing or preemption gives them
back through the scheduler.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cache.grouped_table import SequenceTable
from workers.wire.sampling import SamplingParams


class Priority(enum.IntEnum):
    INTERACTIVE = 0  # scheduled before batch
    BATCH = 1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # stop token or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the caller


_arrivals = itertools.count()

PENDING_TOKEN = -1
"""Stands in `output_ids` for a token sampled on the device whose value the host has not read yet (overlapped
steps, workers/engine/overlap.py): at most one per sequence, always its last; the model runner takes its value
from the device, and the engine writes the value in before anything reads the ids as text or commits them."""


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str = "default"  # set by the caller (the gateway: one per tenant), never by an end user
    priority: Priority = Priority.INTERACTIVE
    index: int = 0  # which of the request's n choices
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = field(default_factory=lambda: next(_arrivals))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    cached_len: int = 0
    # prompt tokens served by the prefix cache at first admission: what usage reports and bills
    # (a preempted sequence's re-admission also hits its own recomputed blocks; that is not billed)
    prompt_cached_len: int = 0
    computed_len: int = 0
    committed_blocks: int = 0  # whole blocks already offered to the prefix tree
    # False: admitted without a prefix-cache hit (it computes prompt logprobs), its blocks stay its own
    # until it leaves: committed while it runs, they would hang in the tree below cached blocks it does
    # not hold, which then count as evictable and are not (cache/manager.py try_grow)
    commits_blocks: bool = True
    block_table: SequenceTable | None = None  # one table per layer group when the model has several
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    pending_forks: int = 0  # choices still to fork from this one when its prompt is computed (n > 1)
    # prefix-match length found when last ordered in the waiting queue (a scheduling hint only)
    match_hint: int = 0
    # the grammar state after output_ids (an xgrammar GrammarMatcher; workers/engine/grammar.py),
    # None when the output is unconstrained. Preemption keeps output_ids, so it keeps this too.
    matcher: Any = None
    weight: float = 1.0  # the tenant's share of service (workers/engine/fairness.py); set by the gateway
    # With params.prompt_logprobs: prompt_logprobs[i] is the log-probability of prompt_ids[i + 1] and
    # prompt_top_logprobs[i] the top k there, filled chunk by chunk (workers/engine/prompt_logprobs.py);
    # dropped by a preemption that comes before they are complete. Forked choices share their parent's.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # speculative decoding (workers/engine/speculative.py): the draft the engine proposed for the next
    # step (the scheduler takes it into the batch or drops it), and the adaptive acceptance state
    draft_ids: list[int] = field(default_factory=list)
    spec_rate: float = 1.0  # moving average of the share of drafted tokens accepted
    spec_cooldown: int = 0  # steps left without drafting
    spec_backoff: int = 0  # the last cool-down (doubles while acceptance stays low)
    spec_drafted: int = 0  # draft tokens this choice verified (kept across preemptions; its request's span)
    spec_accepted: int = 0  # of them, accepted
    # overlapped steps (workers/engine/overlap.py): the pending token (PENDING_TOKEN) is this choice's last
    # (max_tokens or the context reached), so it finishes once the token is read; it runs no step before that
    last_token_pending: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode step's runner wants one id of each)."""
        prompt = len(self.prompt_ids)
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        if end <= prompt:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt]

    @property
    def is_prefilling(self) -> bool:
        return self.computed_len < self.total_len - 1

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: the sequence computes its whole prompt
        (the scheduler gives it no prefix-cache hit)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
