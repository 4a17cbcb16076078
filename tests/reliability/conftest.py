"""Fixtures of the reliability tier: a real gateway over the fake worker, with tenants a and b."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.reliability.stack import Cluster, make_tenants, sqlite_url


@dataclass
class FakeStack:
    cluster: Cluster
    url: str
    keys: dict[str, str]  # tenant name → API key

    @property
    def home(self) -> Path:
        return self.cluster.home


@pytest.fixture(scope="module")
def fake_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeStack]:
    """One gateway process (SQLite, access log on, 3 s slow-loris read timeout) in front of one fake worker; tenants a and b."""
    home = tmp_path_factory.mktemp("fake-stack")
    keys = make_tenants(sqlite_url(home), "a", "b")
    cluster = Cluster.start(home, sqlite_url(home), TOLLWAY_ACCESS_LOG="true", TOLLWAY_READ_TIMEOUT_S="3")
    try:
        yield FakeStack(cluster, cluster.start_gateway(), keys)
    finally:
        cluster.stop()
