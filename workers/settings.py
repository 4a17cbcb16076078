"""Settings of the engine side (env prefix TOLLWAY_)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from workers.wire.telemetry import TracingSettings


class WorkerSettings(TracingSettings):
    """Also the tracing settings (workers/wire/telemetry.py)."""

    model_config = SettingsConfigDict(env_prefix="TOLLWAY_", extra="ignore")

    home: Path = Path(".tollway")
    """State folder: converted models under models/, later the SQLite database and files."""
    model: str = "smollm2-135m-instruct"
    """Built-in model name or path to a local Hugging Face folder."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and matmul dtype; auto = bf16 on CUDA, on CPUs with AMX-BF16, and on CPUs with AVX512-BF16 whose bf16
    GEMM measures >= 1.25x fp32's at start (workers/precision.py), else fp32."""
    quantization: Literal["none", "int8", "int4"] = "none"
    """Weight-only quantization of the decoder's linear layers (embeddings and LM head stay in `dtype`):
    int8 one scale per output channel, int4 groups of 32 with scale and min; from a GGUF's own Q4_0/Q4_1
    (int4) or Q8_0 (int8) blocks where the model came from one (workers/models/quantize.py)."""
    quantized_activations: Literal["int8", "float"] = "int8"
    """What a quantized model's decode steps on a CPU take x as: int8 (rounded per row and block of 32 columns,
    llama.cpp's Q8_0 way, so the products run as integer multiply-adds: AVX512-VNNI, else AVX2) or float (x as
    it is: the dequantized model's results to summation order, slower). Prefill and prompt logprobs always
    take x as it is (kernels/quantized/cpu.py)."""
    device: str = "auto"
    """Where the model runs: auto (the first CUDA GPU when torch sees one, else the CPU), cpu, cuda[:N]."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Ranks the model is split across (workers/parallel/): 1 runs in-process; n > 1 starts n - 1 follower
    processes (gloo on CPU, NCCL on CUDA). Llama / Mistral / Qwen2 only, unquantized; heads must divide."""
    num_threads: int = 0
    """Torch CPU threads; 0 uses every core."""
    kv_cache_dtype: Literal["model", "float16", "bfloat16", "int8"] = "model"
    """What the KV cache stores: model (the model's dtype), or float16 / bfloat16 under an fp32 model on a CPU:
    half the bytes every decode step reads and twice the tokens per MiB, K/V rounded as they are stored
    (llama.cpp keeps f16 K/V by default); or int8 under any model on a CPU: codes with an fp16 scale per 16
    values (kernels/kv_int8.py), 72 bytes per 64 values. workers/precision.py `resolve_kv_cache_dtype`."""
    kv_cache_mb: int = 2048
    """Memory for paged KV blocks (and the prefix cache that lives in them), in MiB."""
    max_batch_tokens: int | None = Field(default=None, ge=1)
    """Token budget of one engine step (prefill chunks + decodes); unset: 1024 on a CPU, 8192 on a GPU
    (workers/engine/config.py STEP_TOKENS)."""
    scheduling: Literal["fair", "fcfs"] = "fair"
    """Admission order when requests wait: fair (per-tenant virtual token counters, workers/engine/fairness.py;
    interactive before batch) or fcfs (interactive before batch, then longest cached prefix, then arrival)."""
    max_running_per_tenant: int = Field(default=0, ge=0)
    """Most sequences one tenant (cache namespace) may run at once on this worker; 0 = no cap. Others' requests
    then find room in every step: a guard for fairness per worker and across a fleet (each worker caps alone)."""
    attention: Literal["auto", "cpu", "native", "triton", "reference"] = "auto"
    """Attention backend: auto (Triton on CUDA; on a CPU native when its C++ ops build here, else cpu), cpu
    (the torch CPU path), native (C++ ops reading the paged cache in place, built once per machine), triton (on a CPU only with
    TRITON_INTERPRET=1), reference (the slow torch reference, for debugging)."""
    cuda_graphs: bool = True
    """On CUDA, decode steps replayed as CUDA graphs captured per batch bucket at start (workers/engine/cuda_graphs.py);
    false: every step eager. No effect on a CPU."""
    overlap: Literal["auto", "on", "off"] = "auto"
    """Overlapped steps (workers/engine/overlap.py): the host schedules and launches step N+1 while the device runs
    step N, reading step N's tokens after. auto: on CUDA; on: also on a CPU (nothing overlaps there: for tests)."""
    compile: Literal["off", "decode"] = "off"
    """decode: the CPU decode step torch.compiled (inductor) per batch bucket, padded to it (cpu and native
    backends, plain Llama layers; workers/engine/compiled_decode.py); each bucket compiles on first use."""
    speculative: Literal["off", "ngram", "draft"] = "off"
    """Speculative decoding (workers/engine/speculative.py): off, ngram (prompt lookup: drafts copied from the
    request's own context, verified in the batched step; outputs exactly as without), draft (a second, smaller
    model, TOLLWAY_DRAFT_MODEL, drafts by greedy decoding: workers/engine/draft_model.py)."""
    draft_model: str | None = None
    """The draft model of TOLLWAY_SPECULATIVE=draft: a model name (as TOLLWAY_MODEL) or a local folder. It must
    share the model's tokenizer (checked at startup); it runs in the model's dtype on its device."""
    speculative_tokens: int = 4
    """Draft tokens proposed per sequence and step (k)."""
    speculative_ngram: int = 3
    """The ngram drafter's longest match (n); it falls back to shorter ones down to 1."""
    speculative_max_batch: int = 16
    """Nobody drafts while more sequences than this decode (the step is compute-bound there; on a 2-core CPU
    with fused verification speculation still won at 4 streams: ops/bench/RESULTS.md, issue 23)."""
    worker_secret: str | None = None
    """The credential every /internal/* call must present (bearer); unset = `$TOLLWAY_HOME/worker.secret`,
    created there if absent (workers/wire/files.py). Give gateways and workers on other hosts the same."""
