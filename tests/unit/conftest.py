"""Fixtures shared by the unit tests of the worker's HTTP API and its test double."""

from __future__ import annotations

import pytest
import torch

from workers.models.loader import LoadedModel, load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random-weight Llama model folder, loaded in fp32."""
    from workers.models.tiny import write_tiny_model_folder

    return load_model(write_tiny_model_folder(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=3), torch.float32)
