"""`ops.offline.engine_config`: the KV cache dtype is checked against the dtype the command was
given (`--dtype`), not the settings' default (`auto` is bf16 on a CPU that computes it faster than fp32)."""

from __future__ import annotations

import click
import pytest

from ops.offline import engine_config
from workers.settings import WorkerSettings


def test_a_float16_cache_is_checked_against_the_dtype_the_command_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLWAY_KV_CACHE_DTYPE", "float16")
    monkeypatch.setenv("TOLLWAY_DEVICE", "cpu")
    monkeypatch.setenv("TOLLWAY_DTYPE", "bfloat16")
    settings = WorkerSettings()
    assert engine_config(settings, "float32").kv_cache_dtype == "float16"
    with pytest.raises(click.ClickException, match="needs an fp32 model"):
        engine_config(settings)  # the settings' own dtype, bf16
    with pytest.raises(click.ClickException, match="needs an fp32 model"):
        engine_config(settings.model_copy(update={"dtype": "float32"}), "bfloat16")
