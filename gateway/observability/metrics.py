"""The gateway's Prometheus metrics (`GET /metrics`, admin key) and its live stats for the dashboard.

Each gateway process has its own registry and is its own scrape target: with several replicas,
sum counters across `instance` (as the Grafana dashboard in ops/ does). Metrics read from shared
state (batches by status, from SQL) are the same on every replica: take `max` across instances.

Label values are bounded: `tenant` is a tenant name (operators create them), `model` a served
model (anything else is "-"), `status` an HTTP-like code (499 = the client left before the end,
502 = the worker failed after admission, even when the stream had already answered 200).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from accounting.models import Batch
from gateway.auth.guards import admin
from gateway.observability.live_stats import LiveStats
from gateway.state import POOL, SESSIONS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
BATCH_STATUS_TTL_S = 5.0  # the batches gauge reads SQL at most this often
UNKNOWN = "-"
BILLED_STATUS_CODES = {"ok": "200", "upstream_error": "502", "client_disconnected": "499"}


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("tollway_requests", "Completion requests by tenant, model and outcome",
                                ["tenant", "model", "status"], registry=registry)
        self.duration = Histogram("tollway_request_duration_seconds", "End-to-end latency of completion requests",
                                  ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("tollway_time_to_first_token_seconds", "Time from arrival to the first token",
                              ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("tollway_inter_token_latency_seconds",
                             "Mean time between tokens after the first, one sample per request",
                             ["model"], buckets=ITL_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("tollway_prompt_tokens", "Prompt tokens billed (cached included)",
                                     ["tenant", "model"], registry=registry)
        self.cached_tokens = Counter("tollway_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     ["tenant", "model"], registry=registry)
        self.completion_tokens = Counter("tollway_completion_tokens", "Completion tokens billed",
                                         ["tenant", "model"], registry=registry)
        self.rejections = Counter("tollway_quota_rejections", "Requests refused by quotas, by reason",
                                  ["tenant", "reason"], registry=registry)
        self.in_flight = Gauge("tollway_requests_in_flight", "Completion requests being answered now",
                               ["model"], registry=registry)
        self.answering = 0
        """Completion requests this process answers now, every model: the in_flight gauge's sum (kept by
        gateway/openai/views.py beside it). Billing commits inline when it is 1 (gateway/upstream/exchange.py)."""
        self.live = LiveStats()

        # Labelled children by (metric, label values): `labels()` validates and hashes its arguments
        # on every call, several times per request; the label sets are bounded (see the module doc).
        self._children: dict[tuple[Counter | Gauge | Histogram, tuple[str, ...]], Any] = {}

    def _child(self, metric: Counter | Gauge | Histogram, *values: str) -> Any:
        child = self._children.get((metric, values))
        if child is None:
            child = self._children[(metric, values)] = metric.labels(*values)
        return child

    def in_flight_of(self, model: str) -> Any:
        """The in_flight gauge of `model` (its labelled child)."""
        return self._child(self.in_flight, model)

    def request_finished(self, tenant: str, model: str, status: str, seconds: float) -> None:
        """One completion request answered (or refused); `status` as in the module doc."""
        self._child(self.requests, tenant, model, status).inc()
        if model != UNKNOWN:
            self._child(self.duration, model).observe(seconds)
        self.live.add_request(error=not status.startswith("2"))

    def billed(self, tenant: str, model: str, usage: dict[str, int], ttft_s: float | None,
               itl_s: float | None) -> None:
        """A usage row was written: its tokens (exactly what was billed) and its latencies."""
        self._child(self.prompt_tokens, tenant, model).inc(usage["prompt_tokens"])
        self._child(self.cached_tokens, tenant, model).inc(usage["cached_tokens"])
        self._child(self.completion_tokens, tenant, model).inc(usage["completion_tokens"])
        if ttft_s is not None:
            self._child(self.ttft, model).observe(ttft_s)
        if itl_s is not None:
            self._child(self.itl, model).observe(itl_s)
        self.live.add_usage(usage["prompt_tokens"], usage["cached_tokens"], usage["completion_tokens"], ttft_s)


METRICS = web.AppKey("metrics", GatewayMetrics)


class StateCollector(Collector):
    """Gauges read at scrape time: workers as this gateway sees them, batches by status (SQL)."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._batches: tuple[float, dict[str, int]] = (0.0, {})

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily("tollway_worker_up", "1 when the worker is in rotation", labels=["worker"])
        in_flight = GaugeMetricFamily("tollway_worker_in_flight", "This gateway's open requests to each worker",
                                      labels=["worker"])
        pool = self._app.get(POOL)
        for worker in pool.workers.values() if pool is not None else ():
            healthy.add_metric([worker.url], float(worker.healthy))
            in_flight.add_metric([worker.url], float(worker.in_flight))
        batches = GaugeMetricFamily("tollway_batches", "Batches by status (shared state: max across replicas)",
                                    labels=["status"])
        for status, count in sorted(self._batches[1].items()):
            batches.add_metric([status], float(count))
        yield from (healthy, in_flight, batches)

    def batch_counts_stale(self) -> bool:
        return time.monotonic() - self._batches[0] > BATCH_STATUS_TTL_S

    def refresh_batches(self) -> None:
        """Counts batches by status (called off the event loop before a scrape, at most every TTL)."""
        with self._app[SESSIONS]() as session:
            rows = session.execute(select(Batch.status, func.count()).group_by(Batch.status)).all()
        self._batches = (time.monotonic(), {status: count for status, count in rows})


STATE_COLLECTOR = web.AppKey("state_collector", StateCollector)


@admin
async def metrics_view(request: web.Request) -> web.Response:
    """Prometheus metrics of this gateway process (admin key as bearer)."""
    collector = request.app[STATE_COLLECTOR]
    if collector.batch_counts_stale():
        await asyncio.to_thread(collector.refresh_batches)
    return web.Response(body=generate_latest(request.app[METRICS].registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def setup_metrics(app: web.Application) -> None:
    app[METRICS] = metrics = GatewayMetrics()
    app[STATE_COLLECTOR] = collector = StateCollector(app)
    metrics.registry.register(collector)
    app.router.add_get("/metrics", metrics_view)
