"""Fixtures the integration tests share (the real default model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.models.loader import LoadedModel, load_model


@pytest.fixture(scope="module")
def fp32(smollm2_folder: Path) -> LoadedModel:
    """The default model loaded in fp32 (the precision of the token-parity tests)."""
    return load_model(smollm2_folder, torch.float32)
