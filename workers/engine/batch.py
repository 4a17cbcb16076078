"""What one scheduled step carries: the batch the scheduler hands the model runner
(`ScheduledBatch`), and what `Scheduler.update` leaves to sample afterwards (`StepUpdate`: the
sampling sequences and the choices (n > 1) forked from them this step, `Fork`, each made by
`fork_choice`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache.manager import KVCacheManager
from workers.engine.request import Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)  # one-token sequences first
    num_new: list[int] = field(default_factory=list)  # tokens each runs this step
    # whether each reaches its newest token this step (computed_len + num_new == total_len): it samples
    # (unless it asked for max_tokens 0: the engine finishes it once its prompt is computed)
    samples: list[bool] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step
    # speculative drafts verified this step (workers/engine/speculative.py): a drafted sequence runs its
    # newest token + the draft (num_new = 1 + len(draft)) and gets logits at all those positions
    drafts: list[list[int]] = field(default_factory=list)

    def add(self, seq: Sequence, num_new: int, copies: list[tuple[int, int]], draft: list[int] | None = None) -> None:
        draft = draft or []
        self.seqs.append(seq)
        self.num_new.append(num_new)
        self.samples.append(seq.computed_len + num_new - len(draft) == seq.total_len and seq.params.max_tokens > 0)
        self.block_copies.extend(copies)
        self.drafts.append(draft)

    def ordered(self) -> ScheduledBatch:
        order = sorted(range(len(self.seqs)), key=lambda i: self.num_new[i] != 1)
        return ScheduledBatch([self.seqs[i] for i in order], [self.num_new[i] for i in order],
                              [self.samples[i] for i in order], self.block_copies,
                              [self.drafts[i] for i in order])

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)

    @property
    def sampling(self) -> list[Sequence]:
        """The sequences that sample after this step, in batch order (the rows of the step's logits)."""
        return [seq for seq, samples in zip(self.seqs, self.samples, strict=True) if samples]


@dataclass(frozen=True)
class Fork:
    parent: Sequence
    child: Sequence  # already running, sharing the parent's blocks
    row: int  # the parent's row in the step's logits: the child draws its first token from it


@dataclass
class StepUpdate:
    """What `Scheduler.update` leaves to sample: the batch's sampling sequences (one per row of
    the step's logits), and the choices forked from them this step."""

    sampling: list[Sequence]
    forks: list[Fork]


def fork_choice(cache: KVCacheManager, parent: Sequence, index: int) -> Sequence:
    """Choice `index` of parent's request: shares every block (copy-on-write for the partly
    filled last one) and every length. The scheduler adopts it as running."""
    assert parent.block_table is not None
    child = Sequence(parent.request_id, parent.prompt_ids, parent.params, parent.namespace, parent.priority,
                     index=index, arrival_time=parent.arrival_time, weight=parent.weight)
    child.block_table = cache.fork(parent.block_table)
    child.computed_len, child.cached_len = parent.computed_len, parent.cached_len
    child.prompt_cached_len, child.committed_blocks = parent.prompt_cached_len, parent.committed_blocks
    child.commits_blocks = parent.commits_blocks
    child.prompt_logprobs, child.prompt_top_logprobs = parent.prompt_logprobs, parent.prompt_top_logprobs
    return child
