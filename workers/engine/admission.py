"""The order in which one step offers waiting sequences for admission, and whom preemption takes:
first come, first served (`fcfs`) or tenant-fair (`fair`, the default; TOLLWAY_SCHEDULING).

A sequence that has waited longer than `max_wait_s` is aged: no request waits without bound.

fcfs (the engine before issue 25): aged sequences first, first come, first served; then
interactive before batch, then the longest cached prefix, then arrival; the first sequence that
does not fit holds back the queue. Preemption takes the newest running batch sequence (the
newest interactive one only when no batch one runs).

fair: interactive before batch (an aged batch sequence counts as interactive: aging lifts the
priority, not the tenant's turn, so a flood that waits long does not turn back into first come,
first served), then the tenant with the smallest virtual token counter
(workers/engine/fairness.py; on a tie, the tenant with fewer sequences running: a newcomer lifted to
the smallest counter goes first), then within the tenant its aged sequences first, then the
longest cached prefix, then arrival. The counters move as sequences are admitted (their prompt is
charged), so the choice is made again for each admission. A sequence that does not fit holds
back only its own tenant for the rest of the step: a smaller request of another tenant is still
admitted; except an aged one of a tenant with nothing running (starved, e.g. a request too big
for the gaps that others keep filling), which holds back everyone until it fits. A backlogged
tenant cannot otherwise starve: its counter stays put while the others' grow. Preemption takes from
the tenant furthest ahead (largest counter): batch first, then that tenant's newest sequence.
Neither ever preempts a sequence already placed in the step's batch (the scheduler's `exclude`).

A per-tenant cap on running sequences (`tenant_cap`, TOLLWAY_MAX_RUNNING_PER_TENANT; 0 = none), under
either policy: a tenant with that many sequences running admits no more this step. Ordering alone
cannot shrink a step that a flood fills; the cap keeps one tenant from filling it (issue 25: a
lone victim's first token then waits on a step of at most `cap` flood sequences per tenant).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from typing import Literal

from workers.engine.fairness import VirtualTokenCounter
from workers.engine.request import Priority, Sequence, Status

Policy = Literal["fcfs", "fair"]
POLICIES: tuple[Policy, ...] = ("fcfs", "fair")


class AdmissionOrder:
    """One step's candidates, best first: `next()` until None; `admitted(seq)` after a candidate
    was admitted; `refused(seq)` after one did not fit tells whether to stop the step's admissions
    (True) or go on with the others."""

    def __init__(self, waiting: Iterable[Sequence], running: Iterable[Sequence], policy: Policy,
                 vtc: VirtualTokenCounter, now: float, max_wait_s: float, tenant_cap: int = 0) -> None:
        self.policy, self.vtc, self.tenant_cap = policy, vtc, tenant_cap
        self._now, self._max_wait_s = now, max_wait_s
        self._running = Counter(seq.namespace for seq in running)  # the tie-break between equal counters
        self._queues: dict[str, list[Sequence]] = {}  # by tenant (one queue under fcfs), best last
        for seq in waiting:
            self._queues.setdefault(seq.namespace if policy == "fair" else "", []).append(seq)
        for queue in self._queues.values():
            queue.sort(key=self._key, reverse=True)

    def aged(self, seq: Sequence) -> bool:
        return self._now - seq.arrival_time > self._max_wait_s

    def _key(self, seq: Sequence) -> tuple:
        if self.aged(seq):
            return (0, seq.arrival_order)
        return (1, seq.priority, -seq.match_hint, seq.arrival_order)

    def _tenant_key(self, tenant: str) -> tuple:
        head = self._queues[tenant][-1]
        priority = Priority.INTERACTIVE if self.aged(head) else head.priority
        return (priority, self.vtc.counter(tenant), self._running[tenant], head.arrival_order)

    def next(self) -> Sequence | None:
        if not self._queues:
            return None
        tenant = min(self._queues, key=self._tenant_key) if len(self._queues) > 1 else next(iter(self._queues))
        queue = self._queues[tenant]
        seq = queue.pop()
        if not queue:
            del self._queues[tenant]
        return seq

    def admitted(self, seq: Sequence) -> None:
        """`seq` now runs (its tenant's count of running sequences goes up)."""
        self._running[seq.namespace] += 1

    def at_cap(self, seq: Sequence) -> bool:
        """Whether `seq`'s tenant already runs `tenant_cap` sequences; under fair the rest of its
        queue then waits for the next step (under fcfs the queue goes on past it)."""
        if not self.tenant_cap or self._running[seq.namespace] < self.tenant_cap:
            return False
        if self.policy == "fair":
            self._queues.pop(seq.namespace, None)
        return True

    def refused(self, seq: Sequence) -> bool:
        """`seq` did not fit the free blocks: True when nothing more is admitted this step."""
        if self.policy == "fcfs" or (self.aged(seq) and not self._running[seq.namespace]):
            return True
        self._queues.pop(seq.namespace, None)  # the rest of its tenant waits for the next step
        return False


def running_order(running: Iterable[Sequence], policy: Policy, vtc: VirtualTokenCounter) -> list[Sequence]:
    """The order in which running sequences get the step's token budget (and blocks to grow):
    oldest first under fcfs; under fair, decodes first (one token each), then the prefills of the
    tenants furthest behind."""
    if policy == "fcfs":
        return sorted(running, key=lambda s: s.arrival_order)
    return sorted(running, key=lambda s: (s.is_prefilling, vtc.counter(s.namespace), s.arrival_order))


def preemption_victim(running: Iterable[Sequence], policy: Policy, vtc: VirtualTokenCounter,
                      exclude: Collection[Sequence]) -> Sequence | None:
    """The running sequence to preempt for blocks, never one in `exclude` (already in the step's
    batch); None when every running sequence is excluded."""
    candidates = [s for s in running if s.status is Status.RUNNING and s not in exclude]
    if not candidates:
        return None
    if policy == "fcfs":
        return max(candidates, key=lambda s: (s.priority, s.arrival_order))
    return max(candidates, key=lambda s: (s.priority is Priority.BATCH, vtc.counter(s.namespace), s.arrival_order))
