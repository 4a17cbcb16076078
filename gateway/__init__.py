"""HTTP gateway: OpenAI-compatible API, auth, quotas, routing, metering (not built yet). Never imports torch."""
