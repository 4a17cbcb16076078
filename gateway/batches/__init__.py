"""OpenAI's Batches API: batch creation and listing, queueing run tasks on Celery by name, and
the identity of batch lines that runners send back through the gateway."""
