"""Virtual Token Counter (VTC; Sheng et al., "Fairness in Serving Large Language Models", OSDI '24):
one counter per tenant of the weighted service it received, which the scheduler reads to choose
whom to admit next and whom to preempt.

A tenant is a request's cache namespace (the gateway sets one per tenant, `tenant-<id>`). Its
counter grows by (input tokens × W_IN + output tokens × W_OUT) / weight as it is served: a
prompt's uncached tokens when it is admitted (the steps right after compute them), each output
token as it is sampled. Prompt tokens served by the prefix cache cost no compute and are not
counted; tokens recomputed after a preemption are not counted twice (the scheduler's choice, not
the tenant's). The weight comes with each request (the tenant's `--weight`, default 1): a tenant
of weight 2 is charged half, so it receives twice the service of a weight-1 tenant.

A tenant is backlogged while it has a request waiting. When one becomes backlogged, its counter is
lifted to the smallest counter among the backlogged tenants (with none, to the counter of the last
tenant that stopped being backlogged), so time spent idle is not banked as credit: a newcomer is
served next, but only at the rate of the others from then on. The paper proves that two tenants
backlogged over an interval receive weighted service within 2·max(W_IN·L_in, W_OUT·M) of each
other (L_in: the longest prompt; M: the most tokens the running batch holds), whatever their
request sizes.

Plain Python, no torch: `tenant_stats()` is what the worker's /metrics and the dashboard show.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

W_IN = 1.0  # weight of an input (prompt) token
W_OUT = 2.0  # weight of an output token: a decode step costs more per token than a prefill chunk


@dataclass
class TenantService:
    """One tenant's figures: `counter` is the VTC (weighted service divided by the weight, lifted when
    the tenant returns from idle); the token counts are what it was actually served."""

    counter: float = 0.0
    weight: float = 1.0
    input_tokens: int = 0
    output_tokens: int = 0


class VirtualTokenCounter:
    def __init__(self, w_in: float = W_IN, w_out: float = W_OUT) -> None:
        self.w_in, self.w_out = w_in, w_out
        self.tenants: dict[str, TenantService] = {}
        self._backlog: dict[str, int] = {}  # tenant -> its waiting sequences (only tenants with some)
        self._floor = 0.0  # the counter of the last tenant that left the backlog

    def _tenant(self, tenant: str) -> TenantService:
        service = self.tenants.get(tenant)
        if service is None:
            service = self.tenants[tenant] = TenantService()
        return service

    def counter(self, tenant: str) -> float:
        service = self.tenants.get(tenant)
        return service.counter if service is not None else 0.0

    # -- the backlog ------------------------------------------------------------------------------
    def enqueue(self, tenant: str, weight: float = 1.0) -> None:
        """A sequence of `tenant` starts waiting (a new request, or a preempted one waiting again).
        A tenant that was not backlogged is lifted to the backlog's smallest counter first."""
        if weight <= 0:
            raise ValueError(f"a tenant's weight must be positive, got {weight}")
        service = self._tenant(tenant)
        service.weight = weight
        if tenant not in self._backlog:
            others = [self.tenants[t].counter for t in self._backlog]
            service.counter = max(service.counter, min(others) if others else self._floor)
            self._backlog[tenant] = 0
        self._backlog[tenant] += 1

    def dequeue(self, tenant: str) -> None:
        """A waiting sequence of `tenant` stopped waiting (admitted, or finished while waiting)."""
        left = self._backlog[tenant] - 1
        if left:
            self._backlog[tenant] = left
        else:
            del self._backlog[tenant]
            self._floor = self.tenants[tenant].counter

    def backlogged(self) -> dict[str, int]:
        """Tenants with waiting sequences, and how many each."""
        return dict(self._backlog)

    # -- service --------------------------------------------------------------------------------
    def charge(self, tenant: str, input_tokens: int = 0, output_tokens: int = 0) -> None:
        service = self._tenant(tenant)
        service.input_tokens += input_tokens
        service.output_tokens += output_tokens
        service.counter += (input_tokens * self.w_in + output_tokens * self.w_out) / service.weight

    def weighted_service(self, tenant: str) -> float:
        """Service received, weighted by token kind and divided by the weight (no lifting): what
        fairness promises to keep level between backlogged tenants."""
        service = self.tenants.get(tenant)
        if service is None:
            return 0.0
        return (service.input_tokens * self.w_in + service.output_tokens * self.w_out) / service.weight

    def stats(self, waiting: Iterable[str], running: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Per tenant: its counter, weight, tokens served, and how many of its sequences are waiting and
        running (the tenants of the waiting and running sequences); what /metrics and the dashboard show."""
        stats: dict[str, dict[str, Any]] = {
            tenant: {"counter": s.counter, "weight": s.weight, "input_tokens": s.input_tokens,
                     "output_tokens": s.output_tokens, "waiting": 0, "running": 0}
            for tenant, s in self.tenants.items()}
        for key, tenants in (("waiting", waiting), ("running", running)):
            for tenant in tenants:
                if tenant in stats:
                    stats[tenant][key] += 1
        return stats
