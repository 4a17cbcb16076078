"""The worker's Prometheus metrics (`GET /metrics`): one registry per worker process.

Counters of what the worker served are incremented as streams end (workers/server/app.py); the
engine's state (queues, KV blocks, prefix-cache hits, preemptions) is read at scrape time from its
last snapshot (`AsyncEngine.info()`, refreshed by the engine thread), so scraping never touches
the engine itself. Each worker is its own scrape target; sum across `instance` for a deployment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class EngineCollector(Collector):
    def __init__(self, info: Callable[[], dict[str, Any]]) -> None:
        self._info = info

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = self._info()
        yield GaugeMetricFamily("tollway_worker_running_requests", "Sequences running in the engine",
                                value=state["running"])
        yield GaugeMetricFamily("tollway_worker_waiting_requests", "Sequences waiting for admission",
                                value=state["waiting"])
        blocks = GaugeMetricFamily("tollway_worker_kv_blocks", "KV blocks by state (total, free, used, evictable)",
                                   labels=["state"])
        for kind, value in state["blocks"].items():
            blocks.add_metric([kind], value)
        yield blocks
        if state.get("kv_utilization") is not None:
            yield GaugeMetricFamily("tollway_worker_kv_utilization",
                                    "Share of the running sequences' block slots that hold tokens",
                                    value=state["kv_utilization"])
        cache = state.get("cache", {}).values()
        yield CounterMetricFamily("tollway_worker_prefix_cache_hit_tokens",
                                  "Prompt tokens found in the prefix cache at admission",
                                  value=sum(s.get("hit_tokens", 0) for s in cache))
        yield CounterMetricFamily("tollway_worker_prefix_cache_miss_tokens",
                                  "Prompt tokens not found in the prefix cache at admission",
                                  value=sum(s.get("miss_tokens", 0) for s in cache))
        yield CounterMetricFamily("tollway_worker_preemptions", "Sequences preempted (recomputed later)",
                                  value=state.get("preemptions", 0))
        spec = state.get("speculative")
        if spec is not None:  # speculative decoding (workers/engine/speculative.py)
            yield CounterMetricFamily("tollway_worker_speculative_drafted_tokens",
                                      "Draft tokens proposed and verified", value=spec["drafted_tokens"])
            yield CounterMetricFamily("tollway_worker_speculative_accepted_tokens",
                                      "Draft tokens accepted by verification", value=spec["accepted_tokens"])
            yield CounterMetricFamily("tollway_worker_speculative_verifications",
                                      "Sequence-steps that verified a draft", value=spec["verifications"])
            yield GaugeMetricFamily("tollway_worker_speculative_acceptance_rate",
                                    "Accepted / drafted tokens since start", value=spec["acceptance_rate"])
            yield GaugeMetricFamily("tollway_worker_speculative_mean_accepted_length",
                                    "Accepted draft tokens per verification since start",
                                    value=spec["mean_accepted_length"])
        yield from _tenant_families(state.get("tenants", {}))


def _tenant_families(tenants: dict[str, dict[str, Any]]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Per tenant (its cache namespace), the fair scheduler's view (workers/engine/fairness.py)."""
    counter = GaugeMetricFamily("tollway_worker_tenant_virtual_tokens",
                                "The tenant's virtual token counter: weighted service / weight, lifted when it "
                                "returns from idle (the fair scheduler admits the smallest first)", labels=["tenant"])
    weight = GaugeMetricFamily("tollway_worker_tenant_weight", "The tenant's scheduling weight", labels=["tenant"])
    waiting = GaugeMetricFamily("tollway_worker_tenant_waiting_requests", "The tenant's sequences waiting",
                                labels=["tenant"])
    running = GaugeMetricFamily("tollway_worker_tenant_running_requests", "The tenant's sequences running",
                                labels=["tenant"])
    tokens = CounterMetricFamily("tollway_worker_tenant_service_tokens",
                                 "Tokens computed for the tenant, first time only (input: uncached prompt; output)",
                                 labels=["tenant", "kind"])
    for tenant, stats in tenants.items():
        counter.add_metric([tenant], stats["counter"])
        weight.add_metric([tenant], stats["weight"])
        waiting.add_metric([tenant], stats["waiting"])
        running.add_metric([tenant], stats["running"])
        tokens.add_metric([tenant, "input"], stats["input_tokens"])
        tokens.add_metric([tenant, "output"], stats["output_tokens"])
    yield from (counter, weight, waiting, running, tokens)


@dataclass
class WorkerMetrics:
    registry: CollectorRegistry
    prompt_tokens: Counter
    cached_tokens: Counter
    completion_tokens: Counter
    finished: Counter


def make_metrics(info: Callable[[], dict[str, Any]]) -> WorkerMetrics:
    """The registry of one worker; `info` returns the engine's state snapshot."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(info))
    return WorkerMetrics(
        registry,
        Counter("tollway_worker_prompt_tokens", "Prompt tokens served", registry=registry),
        Counter("tollway_worker_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                registry=registry),
        Counter("tollway_worker_completion_tokens", "Tokens generated", registry=registry),
        Counter("tollway_worker_choices_finished", "Finished choices by reason", ["reason"], registry=registry),
    )
