"""The tollway CLI (`cli.py`), the process supervisor of `tollway up`, set-up scripts, the fake
worker used by tests and benches, benchmarks (`bench/`) and deploy configs (`deploy/`)."""
