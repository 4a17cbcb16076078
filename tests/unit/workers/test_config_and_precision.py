from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers import precision
from workers.models.config import ModelConfig, ModelConfigError
from workers.models.rope import inverse_frequencies
from workers.models.tiny import tiny_config
from workers.precision import cpu_has_amx_bf16, cpu_has_native_bf16, resolve_device, resolve_dtype


def test_rope_parameters_of_transformers_5_and_legacy_rope_theta_agree() -> None:
    legacy = ModelConfig.from_hf(tiny_config(rope_theta=100000.0))
    modern_dict = tiny_config(rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    del modern_dict["rope_theta"]
    assert ModelConfig.from_hf(modern_dict).rope == legacy.rope


def test_llama3_rope_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf = tiny_config(rope_theta=500000.0, rope_scaling=scaling, head_dim=128, num_attention_heads=4,
                     hidden_size=512)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**hf), "cpu")
    ours = inverse_frequencies(ModelConfig.from_hf(hf).rope, 128)
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize(
    ("override", "message"),
    [({"model_type": "gpt2"}, "not supported"), ({"num_key_value_heads": 3}, "multiple"),
     ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn")],
)
def test_bad_configs_are_rejected_with_a_reason(override: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf({**tiny_config(), **override})


def test_qwen2_has_qkv_bias_and_ignores_unused_window() -> None:
    config = ModelConfig.from_hf(tiny_config("qwen2", sliding_window=4096, use_sliding_window=False))
    assert config.qkv_bias and config.sliding_window is None


def test_dtype_resolution(tmp_path: Path) -> None:
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("auto", "cuda:0") is torch.bfloat16
    assert resolve_dtype("auto") is (torch.bfloat16 if precision.cpu_prefers_bf16() else torch.float32)
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8")
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_has_native_bf16.__wrapped__(fake) is True
    fake.write_text("processor: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n")  # bf16 dot products, no AMX
    assert cpu_has_native_bf16.__wrapped__(fake) is True
    fake.write_text("processor: 0\nflags\t\t: fpu sse avx2 avx512f\n")  # no bf16 instructions
    assert cpu_has_native_bf16.__wrapped__(fake) is False
    fake.write_text("flags\t\t: fpu sse avx2\n")
    assert cpu_has_native_bf16.__wrapped__(fake) is False
    assert cpu_has_amx_bf16.__wrapped__(fake) is False
    fake.write_text("processor: 0\nflags\t\t: fpu avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu_has_amx_bf16.__wrapped__(fake) is True


@pytest.mark.parametrize(("flags", "speedup", "bf16"), [
    ("avx2", 3.0, False),  # no bf16 instructions: fp32, nothing timed
    ("avx512_bf16 amx_bf16", 0.5, True),  # AMX: bf16, nothing timed
    ("avx512_bf16", 2.4, True),  # bf16 dot products at twice fp32's work (AMD Zen 4)
    ("avx512_bf16", 0.54, False),  # no faster than fp32 FMAs (Intel without AMX)
    ("avx512_bf16", precision.BF16_MIN_SPEEDUP, True),
    ("avx512_bf16", 1.1, False),  # a near tie keeps the exact dtype
])
def test_auto_takes_bf16_on_a_cpu_only_where_its_gemm_pays(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           flags: str, speedup: float, bf16: bool) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text(f"processor: 0\nflags\t\t: fpu sse avx2 {flags}\n")
    timed: list[bool] = []

    def measured() -> float:
        timed.append(True)
        return speedup

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: cpu_has_native_bf16.__wrapped__(fake))
    monkeypatch.setattr(precision, "cpu_has_amx_bf16", lambda: cpu_has_amx_bf16.__wrapped__(fake))
    monkeypatch.setattr(precision, "cpu_bf16_speedup", measured)
    assert resolve_dtype("auto") is (torch.bfloat16 if bf16 else torch.float32)
    assert timed == ([True] if flags == "avx512_bf16" else [])  # timed only where the flags leave it open


def test_bf16_speedup_is_measured_on_this_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's GEMMs, timed: a positive ratio where oneDNN has a native bf16 GEMM, else 0; before the native
    library is loaded too, as a worker picks its dtype before loading it (timing the fp32 side on it once gave 0
    there, and `auto` fp32 on every AVX512-BF16 CPU without AMX)."""
    from kernels.cpu import native
    from workers.models.packed_linear import packing_kind

    monkeypatch.setattr(native, "is_loaded", lambda: False)
    speedup = precision.cpu_bf16_speedup.__wrapped__()
    assert (speedup > 0) == (packing_kind(torch.bfloat16) is not None) and speedup < 100


def test_device_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda:0"
    assert resolve_device("cuda:1") == "cuda:1"
