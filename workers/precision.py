"""Choosing where the model runs and in what dtype: CUDA when there is one, else the CPU; bf16 where
the hardware computes it natively and faster than fp32, fp32 elsewhere."""

from __future__ import annotations

import logging
import math
import threading
import time
from functools import cache
from pathlib import Path

import torch

from workers.models.packed_linear import PackedLinear, packing_kind

log = logging.getLogger(__name__)

BF16_MIN_SPEEDUP = 1.25
"""`auto` takes bf16 on a CPU with AVX512-BF16 but no AMX only where the engine's bf16 GEMM runs at least this
much faster than its fp32 one (`cpu_bf16_speedup`). The flag alone does not say: bf16 linears ran 2.4-3x fp32 on
the project's AMD EPYC hosts, but 0.6x at 256 rows on a 2-core Intel Emerald Rapids VM with the same flag (where
the shared-prefix workload ran offline at 125 tok/s in bf16 against 170 in fp32; ops/bench/RESULTS.md "An Intel
AVX512-BF16 host: `auto` picks fp32"). The margin keeps a noisy reading of a near tie from flipping the choice
between starts."""
SPEEDUP_SHAPE = (256, 1024, 1024)
"""(rows, in, out) of the GEMM timed: compute-bound in both dtypes (537 MFLOP a call)."""
SPEEDUP_ROUNDS = 3

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's flags as /proc/cpuinfo lists them (its first `flags` line); empty where it cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@cache
def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU advertises bf16 dot products (AVX512-BF16) or bf16 tile matmuls (AMX-BF16).

    Measured on this project's 2-core AVX512-BF16 host (AMD EPYC, no AMX), SmolLM2-135M's linear
    layers: bf16 3.0x fp32 at M = 32 (271 vs 92 GFLOP/s) and 2.4x at M = 256 (`ops/bench/RESULTS.md`).
    An Intel host with the same flag measured bf16 slower than fp32: see BF16_MIN_SPEEDUP."""
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})


@cache
def cpu_has_amx_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU advertises AMX-BF16 tile matmuls (bf16 GEMMs far ahead of fp32 ones: no timing needed)."""
    return "amx_bf16" in cpu_flags(cpuinfo)


@cache
def cpu_bf16_speedup() -> float:
    """How much faster the engine's bf16 GEMM runs than its fp32 one on this CPU on SPEEDUP_SHAPE, best of
    SPEEDUP_ROUNDS rounds alternating the dtypes: bf16 prepacked for oneDNN (workers/models/packed_linear.py),
    fp32 on `F.linear`, which an fp32 model's GEMMs of that many rows run (`few_rows_linear` takes batches up to
    FEW_ROWS_MAX_ROWS). 0 where oneDNN has no native bf16 GEMM. About 0.1 s, once per process.

    The fp32 side must not depend on the native library: a worker picks its dtype before loading it, and timing
    `few_rows_linear` only where it was loaded sent `auto` to fp32 on every AVX512-BF16 CPU without AMX (from
    83402d7 until 2026-11-27; the stack ran 2-3x slower there, ops/bench/RESULTS.md).

    Timed on a thread of its own, which then ends (with any OpenMP pool it made). Timed in the caller's thread
    instead (a first version, at one torch thread), it slowed a worker's int4 single stream to 35 tok/s from 86:
    presumably the thread-pool effect that workers/engine/async_engine.py describes."""
    bf16_kind = packing_kind(torch.bfloat16)
    if bf16_kind is None:
        return 0.0
    dtypes = (torch.float32, torch.bfloat16)
    best = dict.fromkeys(dtypes, math.inf)

    def measure() -> None:
        rows, k, n = SPEEDUP_SHAPE
        gen = torch.Generator().manual_seed(0)
        weight, x = torch.randn(n, k, generator=gen) / k**0.5, torch.randn(rows, k, generator=gen)
        calls: dict[torch.dtype, tuple[torch.nn.Module, torch.Tensor]] = {}
        for dtype in dtypes:
            linear = torch.nn.Linear(k, n, bias=False, dtype=dtype)
            linear.weight.data.copy_(weight)
            module: torch.nn.Module = PackedLinear(linear, bf16_kind, rows) if dtype == torch.bfloat16 else linear
            calls[dtype] = (module, x.to(dtype))
        with torch.no_grad():
            for module, rows_in in calls.values():  # warm-up: oneDNN builds its kernel on the first call
                module(rows_in)
            for _ in range(SPEEDUP_ROUNDS):
                for dtype, (module, rows_in) in calls.items():
                    start = time.perf_counter()
                    module(rows_in)
                    best[dtype] = min(best[dtype], time.perf_counter() - start)

    timer = threading.Thread(target=measure, name="bf16-speedup")
    timer.start()
    timer.join()
    if math.isinf(best[torch.bfloat16]):
        raise RuntimeError("timing the bf16 and fp32 GEMMs failed (see the thread's traceback above)")
    speedup = best[torch.float32] / best[torch.bfloat16]
    log.info("bf16 GEMM %.2fx fp32's on this CPU (dtype auto takes bf16 from %.2fx)", speedup, BF16_MIN_SPEEDUP)
    return speedup


def cpu_prefers_bf16() -> bool:
    """Whether `auto` runs a CPU model in bf16: AMX-BF16, or AVX512-BF16 whose GEMM measures BF16_MIN_SPEEDUP."""
    if not cpu_has_native_bf16():
        return False
    if cpu_has_amx_bf16():
        return True
    return cpu_bf16_speedup() >= BF16_MIN_SPEEDUP


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """Map a --dtype choice to a torch dtype; `auto` picks bf16 on CUDA, or on CPUs where it pays
    (`cpu_prefers_bf16`), else fp32."""
    if name == "auto":
        if device.startswith("cuda") or cpu_prefers_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


KV_CACHE_DTYPE_CHOICES = ("model", "float16", "bfloat16", "int8")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The KV cache's dtype for a `TOLLWAY_KV_CACHE_DTYPE` choice: `model` is the model's own; float16 or
    bfloat16 store an fp32 model's K/V in half the bytes (the attention kernels widen them to fp32 as they
    read); int8 stores any model's K/V as int8 codes with an fp16 scale per 16 values (kernels/kv_int8.py), on
    any device. float16/bfloat16 under an fp32 model: on a CPU only (the Triton kernels read the model's dtype
    or int8). ValueError for anything else."""
    if name == "model" or DTYPES.get(name) == model_dtype:
        return model_dtype
    if name not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}")
    if name == "int8":
        return torch.int8
    if device_type != "cpu":
        raise ValueError(f"a {name} KV cache under a {model_dtype} model runs on a CPU only (the Triton "
                         "kernels read the model's dtype or int8); use TOLLWAY_KV_CACHE_DTYPE=model or int8")
    if model_dtype != torch.float32:
        raise ValueError(f"a {name} KV cache needs an fp32 model (the model runs in {model_dtype}); "
                         "use TOLLWAY_KV_CACHE_DTYPE=model")
    return DTYPES[name]


def resolve_device(name: str) -> str:
    """Map a --device choice to a torch device string; `auto` is the first GPU when CUDA sees one."""
    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
        return name
    raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)} (or cuda:N)")
