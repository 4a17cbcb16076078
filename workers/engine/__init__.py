"""The engine: sequences and their lengths (`request.py`), continuous batching over the KV cache
facade (`scheduler.py`) and what a scheduled step carries (`batch.py`), one model step (`runner.py`),
sampling (`sampler.py`), stop strings (`detokenize.py`), the step loop (`engine.py`), its settings
(`config.py`) and what it reports (`deltas.py`), and its thread for asyncio callers (`async_engine.py`)."""
