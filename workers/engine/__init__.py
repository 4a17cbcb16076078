"""The engine: sequences and their lengths (`request.py`), continuous batching over the KV cache
facade (`scheduler.py`), one model step (`runner.py`), sampling (`sampler.py`), stop strings
(`detokenize.py`), the step loop (`engine.py`) and its thread for asyncio callers (`async_engine.py`)."""
