"""What a request costs: its meter (one usage row, durable before the final byte), idempotent
replays, and the usage-report and price routes."""
