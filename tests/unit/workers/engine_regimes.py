"""The scheduling regimes engine tests run the tiny model's four prompts (conftest.py `prompts`) through."""

from __future__ import annotations

import pytest

from workers.engine.config import EngineConfig

REGIMES = pytest.mark.parametrize(
    "config",
    [
        EngineConfig(num_blocks=200),  # everything batched together
        EngineConfig(num_blocks=200, max_batch_tokens=16),  # chunked prefill beside decodes
        EngineConfig(num_blocks=12, block_size=8),  # preemption: 12 blocks cannot hold all four
    ],
    ids=["batched", "chunked", "preempting"],
)
"""Parametrizes a test's `config` with each regime."""
