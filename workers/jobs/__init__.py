"""Batch jobs on Celery: the app (`app.py`), its tasks (`tasks.py`) and what they run (`runner.py`).

Run a worker with `celery -A workers.jobs.app worker -Q tollway.batches` (add `-B` on exactly one
worker for the periodic sweep); `tollway up` starts one. Tasks reach the gateway over HTTP only and
keep their state in SQL (accounting/): no result backend.
"""
