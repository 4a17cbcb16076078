"""Seeing the gateway: request spans (OpenTelemetry), Prometheus metrics, live per-second stats,
and the built-in dashboard that shows them with every worker's state and recent traces."""
