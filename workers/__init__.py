"""The engine side: the wire contract (`wire/`, the only part other processes import), the engine
(`engine/`: scheduler, runner, sampler), models (`models/`), the worker's HTTP server (`server/`)
and the Celery batch jobs (`jobs/`)."""
