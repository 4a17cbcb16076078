"""The CI switch TOLLWAY_REQUIRE_SERVICES (tests/required.py): with it, a service fixture whose
service is absent fails its test instead of skipping it, and any skip of a test not marked `gpu` or
`cpu_isa` (hardware this machine may lack) fails the run; without it, the same tests skip with their
reason in the summary.

Each case runs a real pytest session in a subprocess, with tests/conftest.py as its plugin, on a
small test file whose services point at a port where nothing listens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.net import free_port
from tests.required import REQUIRE_SERVICES, require_port

CASES = '''
import pytest


def test_needs_postgres(postgres_url):
    pass


def test_needs_redis(redis_url):
    pass


def test_skips_for_another_reason():
    pytest.skip("a reason that is no service")


@pytest.mark.cpu_isa
def test_needs_an_instruction_set():
    pytest.skip("this CPU lacks it")


@pytest.mark.gpu
def test_needs_a_gpu():
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here")


def test_runs():
    pass
'''


def run_session(tmp_path: Path, require: bool) -> subprocess.CompletedProcess[str]:
    closed = free_port()  # nothing listens there
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TOLLWAY_TEST_POSTGRES_URL": f"postgresql+psycopg2://postgres@127.0.0.1:{closed}/test",
           "TOLLWAY_TEST_REDIS_URL": f"redis://127.0.0.1:{closed}/15"}
    env.pop(REQUIRE_SERVICES, None)
    if require:
        env[REQUIRE_SERVICES] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", str(tmp_path / "test_cases.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_without_the_switch_missing_services_skip_with_their_reason(tmp_path: Path) -> None:
    done = run_session(tmp_path, require=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 5 skipped" in done.stdout
    assert "PostgreSQL is not running on 127.0.0.1:" in done.stdout and "Redis is not running" in done.stdout


def test_with_the_switch_missing_services_fail_and_only_hardware_tests_may_skip(tmp_path: Path) -> None:
    done = run_session(tmp_path, require=True)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    for test in ("test_needs_postgres", "test_needs_redis"):  # an error at setup: the run fails
        assert f"ERROR test_cases.py::{test} - Failed:" in out
    assert out.count(f"{REQUIRE_SERVICES}=1: a missing service or tool fails the test") >= 2
    assert "skips not allowed under TOLLWAY_REQUIRE_SERVICES=1" in out
    assert "SKIPPED (only gpu and cpu_isa tests may skip): test_cases.py::test_skips_for_another_reason" in out
    allowed = out.split("skips not allowed")[1]
    assert "test_needs_a_gpu" not in allowed and "test_needs_an_instruction_set" not in allowed  # hardware skips


def test_the_helper_skips_or_fails_on_a_closed_port(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = free_port()
    monkeypatch.delenv(REQUIRE_SERVICES, raising=False)
    with pytest.raises(pytest.skip.Exception, match="RabbitMQ is not running"):
        require_port("RabbitMQ", "127.0.0.1", closed)
    monkeypatch.setenv(REQUIRE_SERVICES, "1")
    with pytest.raises(pytest.fail.Exception, match="TOLLWAY_REQUIRE_SERVICES=1"):
        require_port("RabbitMQ", "127.0.0.1", closed)
    monkeypatch.setenv(REQUIRE_SERVICES, "0")
    with pytest.raises(pytest.skip.Exception):
        require_port("RabbitMQ", "127.0.0.1", closed)
