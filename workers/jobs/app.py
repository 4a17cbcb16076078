"""The Celery app of the batch jobs: `celery -A workers.jobs.app worker ...`.

Broker: `TOLLWAY_BROKER_URL`, else `TOLLWAY_REDIS_URL` (production), else kombu's SQLAlchemy
transport on SQLite in `$TOLLWAY_HOME/celery-broker.sqlite` (no server; what `tollway up` uses).
No result backend: a batch's state lives in SQL. Tasks are acknowledged late and re-queued if
their worker is lost; the periodic sweep (beat) re-queues batches whose runner vanished without
its message coming back (e.g. a SIGKILLed worker on a broker that only redelivers after its
visibility timeout). Making the app connects to nothing.
"""

from __future__ import annotations

from celery import Celery

from workers.jobs.settings import JobSettings
from workers.wire.batches import QUEUE, SWEEP_TASK


def create_celery_app(settings: JobSettings | None = None) -> Celery:
    settings = settings or JobSettings()
    app = Celery("tollway", broker=settings.celery_broker_url, include=["workers.jobs.tasks"])
    app.conf.update(
        task_default_queue=QUEUE,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        worker_prefetch_multiplier=1,  # a worker holds only the tasks it runs: the others stay queued for others
        broker_connection_retry_on_startup=True,
        beat_schedule={"sweep-stalled-batches": {"task": SWEEP_TASK, "schedule": settings.batch_sweep_interval_s,
                                                 "options": {"queue": QUEUE,
                                                             "expires": settings.batch_sweep_interval_s}}},
    )
    return app


app = create_celery_app()
