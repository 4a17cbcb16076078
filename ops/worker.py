"""`tollway worker`: one engine worker serving the internal HTTP API (workers/server/app.py)."""

from __future__ import annotations

import os

from aiohttp import web
from rich.console import Console

from ops.offline import build_engine, engine_config, serving_model
from ops.startup_heap import frozen_startup_heap
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.models.loader import LoadedModel
from workers.server.app import create_worker_app
from workers.settings import WorkerSettings
from workers.tracing import worker_tracing
from workers.wire.files import load_or_create_worker_secret


def run_worker(settings: WorkerSettings, *, model: str, dtype: str, host: str, port: int, console: Console,
               served_name: str | None = None) -> None:
    """Serve `model` (a name or path) as `served_name` (default: `model` as given), the model id the
    worker's /internal/info reports and gateways route by."""
    secret, _ = load_or_create_worker_secret(settings.worker_secret, settings.home)
    config = engine_config(settings, dtype)  # refuses unusable settings before the model loads
    threads = settings.num_threads or os.cpu_count() or 1
    # The engine thread alone runs torch's parallel work (AsyncEngine `threads`): this thread loads the
    # model on one torch thread, so it never starts an OpenMP pool of its own. (Tensor parallel ranks
    # already run one thread each.)
    loading = settings if settings.tensor_parallel_size > 1 else settings.model_copy(update={"num_threads": 1})
    with serving_model(loading, model, dtype, console) as loaded:
        serve(settings, loaded, config, secret, name=served_name or model, host=host, port=port, console=console,
              threads=threads)


def serve(settings: WorkerSettings, loaded: LoadedModel, config: EngineConfig, secret: str, *, name: str, host: str,
          port: int, console: Console, threads: int = 0) -> None:
    """Serve `loaded` (this process's model, or rank 0's shard of a tensor parallel one) as model id `name`
    until stopped; the engine computes on `threads` torch threads (0: as set)."""
    tracing = worker_tracing(settings)  # None unless TOLLWAY_TRACING / TOLLWAY_OTLP_ENDPOINT
    core = build_engine(loaded, config, name, tracer=tracing.tracer if tracing is not None else None)
    core.grammars.prepare()  # structured outputs' grammar library, loaded before serving
    engine = AsyncEngine(core, threads=threads)
    info = engine.info()
    quantized = "" if loaded.quantization == "none" else f", {loaded.quantization} weights"
    console.print(f"worker: {name} ({info['dtype']}{quantized} on {loaded.model.device}), {info['blocks']['total']} KV blocks "
                  f"of {info['block_size']} tokens ({info['kv_cache_dtype']}), on http://{host}:{port}")
    try:
        # Billed requests' usage not yet acknowledged by a gateway survives a restart of this worker.
        ledger = settings.home / "ledger" / f"worker-{host}-{port}.jsonl"
        app = create_worker_app(engine, tracing, secret=secret, ledger_path=ledger)
        app.cleanup_ctx.append(frozen_startup_heap)  # the loaded model's Python side, torch, transformers
        # handler_cancellation: a client that hangs up cancels its handler, which aborts the request
        web.run_app(app, host=host, port=port, print=None, handler_cancellation=True)
    finally:
        engine.shutdown()
        if tracing is not None:
            tracing.shutdown()
