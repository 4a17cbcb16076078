"""Choosing where the model runs and in what dtype: CUDA when there is one, else the CPU; bf16 where
the hardware computes it natively, fp32 elsewhere."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
DEVICE_CHOICES = ("auto", "cpu", "cuda")


@cache
def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU advertises bf16 dot products (AVX512-BF16) or bf16 tile matmuls (AMX-BF16).

    Measured on this project's 2-core AVX512-BF16 host (AMD EPYC, no AMX), SmolLM2-135M's linear
    layers: bf16 3.0x fp32 at M = 32 (271 vs 92 GFLOP/s) and 2.4x at M = 256 (`ops/bench/RESULTS.md`).
    (An earlier host with the same flag measured no gain; the flag is still the documented rule.)"""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """Map a --dtype choice to a torch dtype; `auto` picks bf16 on CUDA or bf16-capable CPUs."""
    if name == "auto":
        if device.startswith("cuda") or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


KV_CACHE_DTYPE_CHOICES = ("model", "float16", "bfloat16", "int8")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The KV cache's dtype for a `TOLLWAY_KV_CACHE_DTYPE` choice: `model` is the model's own; float16 or
    bfloat16 store an fp32 model's K/V in half the bytes (the attention kernels widen them to fp32 as they
    read); int8 stores any model's K/V as int8 codes with a scale per token and head (kernels/kv_int8.py), on
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
