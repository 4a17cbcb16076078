"""What a test needs from this machine, and what happens when it is missing.

Locally, a test whose service (PostgreSQL, Redis, RabbitMQ) or tool (Chromium, Prometheus, the
default model's package, the PostgreSQL binaries) is absent is skipped, with the reason in the run's
summary (pytest `-ra`). With `TOLLWAY_REQUIRE_SERVICES=1`, as CI sets it (`.ci/run`), the same test
FAILS instead: CI cannot pass by quietly skipping what it was meant to run. The only skips left
there are the GPU tests (marked `gpu`, on machines without CUDA), and tests/conftest.py fails the
session if any other skip got through.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import NoReturn

import pytest

REQUIRE_SERVICES = "TOLLWAY_REQUIRE_SERVICES"


def services_required() -> bool:
    """Whether a missing service fails the test rather than skipping it (TOLLWAY_REQUIRE_SERVICES)."""
    return os.environ.get(REQUIRE_SERVICES, "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> NoReturn:
    """This test cannot run here: skip it, or fail it under TOLLWAY_REQUIRE_SERVICES=1."""
    if services_required():
        pytest.fail(f"{reason} ({REQUIRE_SERVICES}=1: a missing service or tool fails the test)", pytrace=False)
    pytest.skip(reason)


def require_native() -> None:
    """`unavailable` unless the native CPU kernels (kernels/cpu/native) build and load here (a C++ compiler)."""
    from kernels.cpu import native  # imported here: most tests never touch the library

    if not native.load():
        unavailable(str(native.unavailable_reason()))


def bf16_kernels_expected() -> bool:
    """Whether this machine must run the native library's AVX512-BF16 kernels (the quantized tiles, bf16
    few_rows_linear): the library built for AVX512 (torch's CPU capability) on a CPU whose flags list
    AVX512-BF16. Where it must, their being unavailable is a failure, not a skip."""
    import torch

    from workers.precision import cpu_flags

    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and "avx512_bf16" in cpu_flags()


def require_bf16_kernels() -> None:
    """`require_native`, then skip (a CPU without AVX512-BF16; tests marked `cpu_isa`) unless the library's
    AVX512-BF16 kernels run here; fails where `bf16_kernels_expected` says they must."""
    from kernels.cpu import native

    require_native()
    if not native.tile_matmul_available():
        expected = bf16_kernels_expected()
        assert not expected, "this CPU has AVX512-BF16, yet the native bf16 kernels are unavailable"
        pytest.skip("the library's bf16 kernels need AVX512-BF16")


def require_executable(path: Path, what: str) -> None:
    """`unavailable` unless `path` is an executable; `what` says what it is and who installs it."""
    if not os.access(path, os.X_OK):
        unavailable(f"{path} is missing: {what}")


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require_port(name: str, host: str, port: int) -> None:
    """`unavailable` unless something listens on host:port."""
    if not port_open(host, port):
        unavailable(f"{name} is not running on {host}:{port}")
