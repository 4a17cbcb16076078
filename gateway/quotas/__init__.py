"""Per-tenant quotas (rpm, tpm, concurrency, monthly budget): the store interface and its rules,
the in-process and Redis stores with failover, and the admission stage of a request."""
