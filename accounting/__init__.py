"""SQL accounting: tenants, keys, usage, prices, billing reports (not built yet)."""
