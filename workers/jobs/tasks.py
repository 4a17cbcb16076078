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

from sqlalchemy.orm import Session, sessionmaker

from accounting import batch_runs
from accounting.db import create_db_engine, session_factory
from accounting.file_store import LocalFileStore
from workers.jobs.app import QUEUE, RUN_TASK, SWEEP_TASK, app
from workers.jobs.runner import BatchStep, RunnerConfig
from workers.jobs.settings import job_settings

log = logging.getLogger("tollway.jobs")
RETRY_LATER_S = 5.0
_limits = job_settings()
STEP_TIME_LIMIT_S = _limits.batch_step_s + _limits.batch_line_timeout_s + 120


@functools.cache
def sessions() -> sessionmaker[Session]:
    """The accounting database, opened on first use (once per worker process)."""
    return session_factory(create_db_engine(job_settings().database))


def queue_run(batch_id: str, countdown: float | None = None) -> None:
    """Queue a run task for the batch and note when (the sweep looks at it)."""
    run_batch.apply_async(args=[batch_id], queue=QUEUE, countdown=countdown)
    with sessions()() as session, session.begin():
        batch_runs.mark_dispatched(session, batch_id)


@app.task(name=RUN_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True,
          soft_time_limit=STEP_TIME_LIMIT_S, time_limit=STEP_TIME_LIMIT_S + 60)
def run_batch(batch_id: str) -> str:
    """Run one step of a batch; queue the next step when the batch is not done."""
    settings = job_settings()
    config = RunnerConfig(gateway_url=settings.gateway_url, admin_key=settings.resolved_admin_key(),
                          concurrency=settings.batch_line_concurrency, lease_s=settings.batch_lease_s,
                          step_s=settings.batch_step_s, line_timeout_s=settings.batch_line_timeout_s)
    runner_id = f"{socket.gethostname()[:30]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    step = BatchStep(batch_id, runner_id, sessions(), LocalFileStore(settings.home / "files"), config)
    outcome = asyncio.run(step.run())
    log.info("batch %s: step by %s ended: %s", batch_id, runner_id, outcome)
    if outcome in ("continue", "retry_later"):
        queue_run(batch_id, countdown=RETRY_LATER_S if outcome == "retry_later" else None)
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
