"""Continuous batching over the prefix cache: which sequences run which tokens in the next step.

Each step has a token budget. Running sequences come first: decodes (one token each), then
unfinished prefills in chunks. Waiting sequences are then admitted in the order of the scheduling
policy (workers/engine/admission.py): `fair` (default) serves the tenant with the smallest virtual
token counter (workers/engine/fairness.py), interactive before batch; `fcfs` is interactive before
batch, then longest cached prefix, then arrival. Under both, a sequence that has waited longer
than `max_wait_s` is aged (no request waits without bound): under fcfs it goes ahead of every
non-aged one, under fair it counts as interactive.
Admission matches the prompt in the radix tree (hit/miss counted once per admission, not per
attempt), locks the matched path and allocates blocks only for the rest; a sequence that still
needs prompt logprobs matches nothing, computes its whole prompt in blocks of its own and offers
them to the tree only when it leaves (workers/engine/prompt_logprobs.py).
Blocks come and go only through the cache facade (`cache.manager.KVCacheManager`).

Batch priority yields: while any interactive sequence is running or waiting, batch sequences
(running or waiting) sit out the step, keeping their blocks, unless they have aged past
`max_wait_s`. Steps then cost what the interactive work alone costs, so a batch in progress adds
to an interactive request's latency at most the remainder of the step it arrived during.

When blocks run out, a running sequence not yet placed in this step's batch is preempted by
recompute (admission.py says which: batch first; under fair, from the tenant furthest ahead): its
computed whole blocks go into the prefix tree (so recomputing mostly hits the cache), its blocks
are released, and it waits again with its output kept. A sequence that cannot fit even alone
finishes with `length` (handed to the engine by `take_finished`). Finished and aborted sequences
insert prompt + output into the tree, then release.

After the model ran a step, `update` owns what changed: computed lengths, whole blocks committed
to the tree while their sequence still runs (requests sharing the prefix hit them at once), the
tenants' service counters (output tokens sampled), and the forks of a request's other choices
(n > 1) once its prompt is computed, sharing its blocks. What a step carries (the batch, the
update, the forks and how a forked choice is made) lives in workers/engine/batch.py.
"""

from __future__ import annotations

import time
from typing import Any

from cache.manager import KVCacheManager
from workers.engine.admission import POLICIES, AdmissionOrder, Policy, preemption_victim, running_order
from workers.engine.batch import Fork, ScheduledBatch, StepUpdate, fork_choice
from workers.engine.fairness import VirtualTokenCounter
from workers.engine.request import FinishReason, Priority, Sequence, Status


class Scheduler:
    def __init__(
        self, cache: KVCacheManager, max_batch_tokens: int = 512, max_running: int = 64, max_wait_s: float = 30.0,
        policy: Policy = "fair", max_running_per_tenant: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.cache = cache  # the block pool + prefix tree pair; every block goes through it
        self.max_batch_tokens, self.max_running, self.max_wait_s = max_batch_tokens, max_running, max_wait_s
        self.policy = policy
        self.max_running_per_tenant = max_running_per_tenant  # 0: no cap (workers/engine/admission.py)
        # Sliding windows live in the tables the cache hands out (each group's): blocks wholly outside
        # a sequence's window are given back before each step, and a running sequence commits only
        # what `cache.committable_blocks` allows (a committed block stays pinned while blocks below
        # it are held).
        self.vtc = VirtualTokenCounter()  # kept under both policies (metrics); only `fair` orders by it
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._finished: list[Sequence] = []  # finished here (could never fit) until `take_finished`
        self.preemptions = 0  # since start (metrics; the engine's phase spans watch it change)

    # -- queue ----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.vtc.enqueue(seq.namespace, seq.weight)

    def _leave_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.vtc.dequeue(seq.namespace)

    def adopt_running(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (a forked choice) joins the running set."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admission_order(self, now: float) -> AdmissionOrder:
        for seq in self.waiting:
            seq.match_hint = 0 if seq.needs_prompt_logprobs else self.cache.peek(seq.namespace, seq.all_ids)
        return AdmissionOrder(self.waiting, self.running, self.policy, self.vtc, now, self.max_wait_s,
                              self.max_running_per_tenant)

    def _sits_out(self, seq: Sequence, now: float, interactive_present: bool) -> bool:
        """A batch sequence yields the step to interactive work, unless it has aged."""
        return interactive_present and seq.priority is Priority.BATCH and now - seq.arrival_time <= self.max_wait_s

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_batch_tokens
        now = time.monotonic()
        interactive_present = any(s.priority is Priority.INTERACTIVE for s in self.running) or any(
            s.priority is Priority.INTERACTIVE for s in self.waiting)
        scheduled: set[Sequence] = set()  # in this step's batch: never preempted for another's blocks
        for seq in running_order(self.running, self.policy, self.vtc):
            if (seq.status is not Status.RUNNING or budget == 0 or seq.last_token_pending
                    or self._sits_out(seq, now, interactive_present)):
                continue
            draft, seq.draft_ids = seq.draft_ids, []  # the engine's proposal, for this step only
            if seq.block_table is not None:  # give back the blocks no query of this step can see
                seq.block_table.drop_out_of_window(seq.computed_len)
            copies = self._grow_draft(seq, draft, budget)
            if copies is None:
                draft = []
                num_new = min(seq.total_len - seq.computed_len, budget)
                copies = self._grow(seq, num_new, scheduled)
                if copies is None:
                    continue  # seq itself was preempted or finished
            else:
                num_new = 1 + len(draft)
            batch.add(seq, num_new, copies, draft)
            scheduled.add(seq)
            budget -= num_new
        # Next uncached block of each sequence computing its prompt: a waiting sequence whose next
        # block is the same would compute that prefix twice, so it waits and then hits the blocks
        # the first one commits.
        bs = self.cache.block_size
        in_flight = {  # running prefills count too (not those sitting out): their next block is committed soon
            (s.namespace, tuple(s.all_ids[: s.committed_blocks * bs + bs]))
            for s in self.running if s.status is Status.RUNNING and s.commits_blocks
            and s.committed_blocks * bs + bs <= s.prompt_len
            and not self._sits_out(s, now, interactive_present)
        }
        order = self._admission_order(now)
        for seq in iter(order.next, None):
            if budget == 0 or len(self.running) >= self.max_running:
                break
            if seq.last_token_pending or self._sits_out(seq, now, interactive_present) or order.at_cap(seq):
                continue
            next_block = (seq.namespace, tuple(seq.all_ids[: seq.match_hint + bs]))
            if next_block in in_flight:
                continue
            in_flight.add(next_block)
            admitted = self._admit(seq, budget, batch)
            if admitted is None:
                if order.refused(seq):
                    break  # fcfs, or an aged sequence: it keeps its place, nobody jumps it for blocks
                continue  # fair: only its own tenant waits for the next step
            if admitted:
                order.admitted(seq)
            budget -= admitted
        return batch.ordered()

    def _grow(self, seq: Sequence, num_new: int, scheduled: set[Sequence]) -> list[tuple[int, int]] | None:
        """Blocks for num_new more tokens, preempting other sequences not in `scheduled` (this step's
        batch) if needed; None if seq lost its place."""
        table = seq.block_table
        assert table is not None
        while (copies := self.cache.try_grow(table, num_new)) is None:
            victim = preemption_victim(self.running, self.policy, self.vtc, scheduled)
            assert victim is not None  # seq itself is running and not yet scheduled
            if victim is seq and len(self.running) == 1:
                self.finish(seq, FinishReason.LENGTH)  # cannot fit even alone
                self._finished.append(seq)
                return None
            self.preempt(victim)
            if victim is seq:
                return None
        return copies

    def _grow_draft(self, seq: Sequence, draft: list[int], budget: int) -> list[tuple[int, int]] | None:
        """Blocks for a decoding sequence's newest token + its draft, when the budget and free (or
        evictable) blocks allow without preempting anyone; None: it runs without the draft."""
        if not draft or seq.computed_len != seq.total_len - 1 or 1 + len(draft) > budget:
            return None
        assert seq.block_table is not None
        return self.cache.try_grow(seq.block_table, 1 + len(draft))

    def _admit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int | None:
        """Tokens scheduled for seq (0 if it had to finish: it can never fit); None when blocks are short."""
        # seq now holds the matched blocks; the hit is counted below, once it is admitted. A sequence
        # still to compute prompt logprobs takes no hit: it needs every prompt position's logits
        # (recompute, workers/engine/prompt_logprobs.py); its blocks go to the tree when it leaves.
        recompute = seq.needs_prompt_logprobs
        hit = self.cache.no_match() if recompute else self.cache.match_and_lock(seq.namespace, seq.all_ids,
                                                                                 count=False)
        table, cached = hit.table, hit.cached_len
        table.drop_out_of_window(cached)
        num_new = min(seq.total_len - cached, budget)
        copies = self.cache.try_grow(table, num_new)
        if copies is None:
            self.cache.release(table)
            if not self.running:  # nothing will ever free blocks for it
                self._leave_waiting(seq)
                self.finish(seq, FinishReason.LENGTH)
                self._finished.append(seq)
                return 0  # keep admitting others
            return None
        self.cache.count_match(seq.namespace, seq.total_len, hit.num_matched_blocks * self.cache.block_size)
        seq.block_table = table
        seq.cached_len = seq.computed_len = cached
        if seq.num_preemptions == 0:  # first admission: its uncached prompt is its input service
            seq.prompt_cached_len = min(cached, seq.prompt_len)
            self.vtc.charge(seq.namespace, input_tokens=seq.prompt_len - seq.prompt_cached_len)
        seq.committed_blocks = hit.num_matched_blocks
        seq.commits_blocks = not recompute
        seq.status = Status.RUNNING
        self._leave_waiting(seq)
        self.running.append(seq)
        batch.add(seq, num_new, hit.copies + copies)
        return num_new

    def take_finished(self) -> list[Sequence]:
        """Sequences the scheduler itself finished (`length`: they can never fit) since the last call."""
        done, self._finished = self._finished, []
        return done

    # -- after the model ran --------------------------------------------------------------------
    def update(self, batch: ScheduledBatch) -> StepUpdate:
        """After the model ran `batch`: advance each sequence's computed length, commit its newly
        computed whole blocks, and fork the pending choices (n > 1) of the sequences whose prompt
        is now computed. Runs before sampling: forked choices draw their first token from their
        parent's logits in the same draw."""
        for seq, n, draft in zip(batch.seqs, batch.num_new, batch.drafts, strict=True):
            seq.computed_len += n - len(draft)  # a draft's slots count once verified (`settle_draft`)
            if not draft:
                self._commit_computed(seq)
        sampling = batch.sampling
        forks = []
        for row, parent in enumerate(sampling):
            if parent.finished:  # an overlapped step's choice that ended on the token before (overlap.py)
                continue
            self.vtc.charge(parent.namespace, output_tokens=1 + parent.pending_forks)  # a token per choice
            if parent.pending_forks == 0 or parent.block_table is None:
                continue
            for index in range(1, parent.pending_forks + 1):
                child = fork_choice(self.cache, parent, index)
                self.adopt_running(child)  # it runs from now on
                forks.append(Fork(parent, child, row))
            parent.pending_forks = 0
        return StepUpdate(sampling, forks)

    def settle_draft(self, seq: Sequence, accepted: int) -> None:
        """After verification: the first `accepted` draft slots hold K/V of tokens now in the output;
        the rest are rolled back (blocks wholly beyond given back). Only then are whole blocks
        committed to the prefix tree, so it never indexes a rejected token."""
        table = seq.block_table
        if table is None:  # finished while its tokens were appended: released already
            return
        seq.computed_len += accepted
        assert seq.computed_len <= seq.total_len
        table.truncate(seq.computed_len)
        self._commit_computed(seq)

    def _commit_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed whole blocks to the tree right away, so that
        requests sharing its prefix hit them while it is still running (the tree adds its own
        references; full blocks are never written again)."""
        table = seq.block_table
        full_blocks = self.cache.committable_blocks(seq.computed_len, seq.prompt_len)
        if table is None or not seq.commits_blocks or full_blocks <= seq.committed_blocks:
            return
        self.cache.commit(seq.namespace, seq.all_ids[: full_blocks * self.cache.block_size], table)
        seq.committed_blocks = full_blocks

    # -- leaving ----------------------------------------------------------------------------------
    def _cache_and_release(self, seq: Sequence) -> None:
        """Put the sequence's computed whole blocks into the tree, then give back its references."""
        table = seq.block_table
        if table is None:
            return
        self.cache.cache_and_release(seq.namespace, seq.all_ids[: seq.computed_len], table)
        seq.block_table = None

    def preempt(self, seq: Sequence) -> None:
        self._cache_and_release(seq)
        self.running.remove(seq)
        if seq.needs_prompt_logprobs:  # incomplete: it computes its prompt again from position 0
            seq.prompt_logprobs, seq.prompt_top_logprobs = [], []
        seq.computed_len = seq.cached_len = seq.committed_blocks = 0
        seq.num_preemptions += 1
        self.preemptions += 1
        self.add(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._cache_and_release(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self._leave_waiting(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def sequences_of(self, request_id: str) -> list[Sequence]:
        """The request's open choices: running ones, then waiting ones."""
        return [s for s in self.running + self.waiting if s.request_id == request_id]

    def tenant_stats(self) -> dict[str, dict[str, Any]]:
        """Per tenant: counter, weight, tokens served, sequences waiting and running (VirtualTokenCounter.stats)."""
        return self.vtc.stats([s.namespace for s in self.waiting], [s.namespace for s in self.running])

    def kv_utilization(self) -> tuple[int, int]:
        """(tokens held, capacity) of the blocks running sequences hold; a shared block counts once."""
        filled: dict[int, int] = {}
        bs = self.cache.block_size
        for seq in self.running:
            if seq.block_table is None:
                continue
            for table in seq.block_table.groups:
                for i, block in enumerate(table.held_ids, start=table.num_dropped):
                    in_block = min(max(seq.computed_len - i * bs, 0), bs)
                    filled[block] = max(filled.get(block, 0), in_block)
        return sum(filled.values()), len(filled) * bs

    def check_integrity(self) -> None:
        """Pool and tree agree with what running sequences hold (AssertionError otherwise)."""
        self.cache.check_integrity(seq.block_table for seq in self.running if seq.block_table is not None)
