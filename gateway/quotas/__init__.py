"""Per-tenant quotas (rpm, tpm, concurrency, monthly budget): the store interface and the rules
every store applies, the in-process and Redis stores with failover, and the admission stage of a request."""
