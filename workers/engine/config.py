"""The engine's settings (`EngineConfig`): cache size, batching limits, attention backend,
scheduling policy and speculative decoding. `Engine` (workers/engine/engine.py) reads them once at
start; the worker and the CLI build them from the worker's settings (`engine_config` in ops/offline.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kernels.dispatch import AttentionChoice
from workers.engine.admission import Policy
from workers.engine.drafter import SpeculativeMode

CompileMode = Literal["off", "decode"]
OverlapMode = Literal["auto", "on", "off"]  # overlapped steps (workers/engine/overlap.py)
# One step's token budget (prefill chunks + decodes) when the config leaves it open. A CPU step's time
# grows with its tokens, so a small budget keeps decodes flowing beside long prompts; a GPU step of
# 8,192 tokens costs little more than one of 1,024 (launches and weights dominate), and fewer eager
# prefill steps before the graphed decodes pay (ops/bench/gpu_engine.py: no sharing 4 x 8 x 380 tokens).
STEP_TOKENS = {"cpu": 1024, "cuda": 8192}


def step_token_budget(max_batch_tokens: int | None, device_type: str) -> int:
    """The step budget: the configured one, else the device's default (STEP_TOKENS)."""
    return max_batch_tokens or STEP_TOKENS.get(device_type, STEP_TOKENS["cpu"])


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 8  # 16 left up to 12% of allocated slots empty at peak when decodes cross blocks together
    num_blocks: int | None = None  # None: sized from kv_budget_bytes
    kv_budget_bytes: int = 2 * 2**30
    kv_cache_dtype: str = "model"  # the cache's dtype: model, float16, bfloat16 (workers/precision.py)
    max_batch_tokens: int | None = None  # None: STEP_TOKENS by device (step_token_budget)
    max_running: int = 64
    max_running_per_tenant: int = 0  # 0: no cap on one tenant's running sequences (admission.py)
    max_wait_s: float = 30.0
    max_context: int | None = None  # None: the model's max_position_embeddings (capped at 8192)
    attention: AttentionChoice = "auto"  # the attention backend (kernels/dispatch.py); auto: by device
    compile: CompileMode = "off"  # decode: the CPU decode step torch.compiled per batch bucket (compiled_decode.py)
    cuda_graphs: bool = True  # on CUDA, decode steps replayed as CUDA graphs by batch bucket (cuda_graphs.py)
    # the host schedules step N+1 while the device runs step N (overlap.py); auto: on CUDA, on: also on a CPU
    overlap: OverlapMode = "auto"
    scheduling: Policy = "fair"  # admission and preemption order (workers/engine/admission.py)
    speculative: SpeculativeMode = "off"  # speculative decoding's drafter (workers/engine/drafter.py)
    speculative_tokens: int = 4  # draft tokens proposed per sequence and step (k)
    speculative_ngram: int = 3  # the ngram drafter's longest match (n); it tries n, n-1, ..., 1
    draft_model: str | None = None  # the draft model's folder (speculative `draft`; workers/engine/draft_model.py)
    speculative_max_batch: int = 16  # nobody drafts while more sequences than this decode (compute-bound)
    # Drafting backs off where measured steps say it loses (workers/engine/spec_governor.py); False:
    # acceptance and batch size alone decide (deterministic, for tests that count verifications).
    speculative_timed: bool = True
