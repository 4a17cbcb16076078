"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
import torch

from workers.models import packed_linear


@pytest.fixture
def few_rows_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every call PackedLinear makes to `few_rows_linear` while the test runs, in order."""
    calls: list[int] = []
    real = torch.ops.tollway_cpu.few_rows_linear

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(packed_linear, "_few_rows_linear", counted)
    return calls
