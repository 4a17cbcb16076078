"""Fixtures shared by the unit tests of the worker's HTTP API and its test double."""

from __future__ import annotations

import time

import pytest
import pytest_asyncio
import torch

from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.deltas import Delta
from workers.engine.engine import Engine
from workers.models.loader import LoadedModel, load_model
from workers.server.app import create_worker_app

WORKER_SECRET = "tw-worker-unit-secret"


class PacedEngine(Engine):
    """The engine with a pause before each step. On the tiny model a whole 512-token request takes
    0.1-0.2 s, less than the tests of hang-ups and cancels need to act while a request runs; paced,
    it takes ~2.5 s. What the tests check (the server around the engine) is unchanged."""

    STEP_PAUSE_S = 0.005

    def step(self) -> list[Delta]:
        time.sleep(self.STEP_PAUSE_S)
        return super().step()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random-weight Llama model folder, loaded in fp32."""
    from workers.models.tiny import write_tiny_model_folder

    return load_model(write_tiny_model_folder(tmp_path_factory.mktemp("tiny") / "m", "llama", seed=3), torch.float32)


@pytest_asyncio.fixture
async def worker(tiny: LoadedModel, aiohttp_client):
    """The real worker app on the tiny model, served: (test client, its AsyncEngine). The client
    sends the worker's secret (`WORKER_SECRET`) on every call, as the gateway does."""
    engine = AsyncEngine(PacedEngine(tiny, EngineConfig(num_blocks=64, block_size=8), name="tiny"))
    client = await aiohttp_client(create_worker_app(engine, secret=WORKER_SECRET),
                                  headers={"Authorization": f"Bearer {WORKER_SECRET}"})
    yield client, engine
    engine.shutdown()
