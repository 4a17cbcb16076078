"""Fixtures shared by the engine's tests on the tiny model (tests/unit/conftest.py `tiny`)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Four prompts sharing a 40-token system prompt, then 5, 17, 1 and 30 tokens of their own (a module
    may define its own `prompts`, e.g. over a smaller alphabet)."""
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, 128, (40,), generator=gen).tolist()
    return [system + torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 17, 1, 30)]
