"""The worker's internal HTTP API (`app.py`): generate over NDJSON or the channel (`channel.py`),
cancel, info, tokenizer, traces, health and metrics (`metrics.py`)."""
