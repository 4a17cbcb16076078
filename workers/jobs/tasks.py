"""The Celery tasks of batch jobs. They take ids only and keep every state in SQL.

- `tollway.batches.run(batch_id)`: one step of the batch (workers/jobs/runner.py); when the step
  ends before the batch does, it queues its own continuation, so batches take turns on the workers.
  Idempotent: a duplicate delivery finds the lease taken or the batch ended and does nothing, and a
  line with a recorded result is never run again.
- `tollway.batches.sweep()`: (beat) re-queues unfinished batches whose runner vanished.

Time limits: a step stops starting lines after `TOLLWAY_BATCH_STEP_S`; the Celery limits below
back that up by a line's timeout (they are enforced by the prefork pool; `tollway up` runs the
threads pool, where the step's own deadline is the limit).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import uuid

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Tracer
from sqlalchemy.orm import Session, sessionmaker

from accounting import batch_runs
from accounting.db import create_db_engine, session_factory
from accounting.file_store import LocalFileStore
from accounting.settings import AccountingSettings
from workers.jobs.app import app
from workers.jobs.runner import BatchStep, RunnerConfig
from workers.jobs.settings import job_settings
from workers.tracing import WorkerTracing, worker_tracing
from workers.wire.batches import QUEUE, RUN_TASK, SWEEP_TASK
from workers.wire.telemetry import PROPAGATOR

log = logging.getLogger("tollway.jobs")
RETRY_LATER_S = 5.0
_limits = job_settings()
STEP_TIME_LIMIT_S = _limits.batch_step_s + _limits.batch_line_timeout_s + 120


@functools.cache
def sessions() -> sessionmaker[Session]:
    """The accounting database, opened on first use (once per worker process)."""
    return session_factory(create_db_engine(AccountingSettings().url))


@functools.cache
def tracing() -> WorkerTracing | None:
    """This process's tracer (None when tracing is off), made on first use."""
    return worker_tracing(job_settings(), "tollway-batch-worker")


def queue_run(batch_id: str, countdown: float | None = None, link: str | None = None) -> None:
    """Queue a run task for the batch and note when (the sweep looks at it). `link`: the traceparent
    of the request that created the batch, handed on from step to step."""
    run_batch.apply_async(args=[batch_id], kwargs={"link": link} if link else None, queue=QUEUE,
                          countdown=countdown)
    with sessions()() as session, session.begin():
        batch_runs.mark_dispatched(session, batch_id)


@app.task(name=RUN_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
          soft_time_limit=STEP_TIME_LIMIT_S, time_limit=STEP_TIME_LIMIT_S + 60)
def run_batch(batch_id: str, link: str | None = None) -> str:
    """Run one step of a batch; queue the next step when the batch is not done.

    Traced (when on) as a CONSUMER span linked to the trace that created the batch (`link`, a W3C
    traceparent): a batch runs in many steps over hours, so the steps are links, not children;
    each line is a child span whose traceparent the gateway continues."""
    traced = tracing()
    if traced is None:
        return _run_step(batch_id, None, link)
    with traced.tracer.start_as_current_span(
            RUN_TASK, kind=SpanKind.CONSUMER, links=batch_links(link), attributes={"tollway.batch.id": batch_id, "messaging.system": "celery",
                        "messaging.destination.name": QUEUE}) as span:
        outcome = _run_step(batch_id, traced.tracer, link)
        span.set_attribute("tollway.batch.step_outcome", outcome)
        return outcome


def batch_links(link: str | None) -> list[Link]:
    """A link to the span that created the batch, from its traceparent (none if absent or malformed)."""
    if not link:
        return []
    context = trace.get_current_span(PROPAGATOR.extract({"traceparent": link})).get_span_context()
    return [Link(context)] if context.is_valid else []


def _run_step(batch_id: str, tracer: Tracer | None, link: str | None) -> str:
    settings = job_settings()
    config = RunnerConfig(gateway_url=settings.gateway_url, admin_key=settings.resolved_admin_key(),
                          concurrency=settings.batch_line_concurrency, lease_s=settings.batch_lease_s,
                          step_s=settings.batch_step_s, line_timeout_s=settings.batch_line_timeout_s)
    runner_id = f"{socket.gethostname()[:30]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    step = BatchStep(batch_id, runner_id, sessions(), LocalFileStore(settings.home / "files"), config, tracer)
    outcome = asyncio.run(step.run())
    log.info("batch %s: step by %s ended: %s", batch_id, runner_id, outcome)
    if outcome in ("continue", "retry_later"):
        queue_run(batch_id, countdown=RETRY_LATER_S if outcome == "retry_later" else None, link=link)
    return outcome


@app.task(name=SWEEP_TASK, ignore_result=True, soft_time_limit=60, time_limit=90)
def sweep() -> list[str]:
    """Queue a run task for every unfinished batch whose runner vanished (or whose task was lost)."""
    settings = job_settings()
    with sessions()() as session, session.begin():
        stalled = batch_runs.stalled_batches(session, settings.batch_redispatch_after_s)
    for batch_id in stalled:
        log.info("batch %s has no live runner: queueing it again", batch_id)
        queue_run(batch_id)
    return stalled
