"""Who is calling: tenant API keys (cached lookups, invalidated across replicas), the admin key,
the dashboard's session, the guards every view is wrapped in, and the tenant/key admin API."""
