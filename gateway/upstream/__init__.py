"""The engine workers behind the gateway: the pool (health, models, load), the cache-aware router,
each worker's generate channel, and the exchange that carries one admitted request to a worker
and its answer back, with retries and hang-up handling."""
