"""KV block pool and radix prefix tree (not built yet)."""
