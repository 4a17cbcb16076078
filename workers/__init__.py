"""The engine side: models, offline generation, and (later) scheduler, worker server and Celery jobs."""
