#!/usr/bin/env bash
# Wheels a lent GPU machine needs to run the engine's GPU tests and ops/bench/gpu_engine.py.
#
# The device machine's image has torch, Triton and transformers but not the rest of the project's
# dependencies, and it reaches no package index. Run this here (where the index is reachable); it
# downloads, into .whl/ (git-ignored), the wheels for the device's Python (3.12, manylinux x86_64).
# Then carry .whl to the device (the `run` tool's carry: [".whl"]) and, there, in one command:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD \
#     && python3 -m pytest -q -x tests/unit/kernels/test_gpu.py -k "engine or captured or store or int8" \
#     && python3 ops/bench/gpu_engine.py --parts workloads,step,single --host-profile 30
#
# (The whole Triton kernel grid of test_gpu.py takes over 4 minutes: run it apart when time allows.)
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-.venv/bin/python}"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions orjson sqlalchemy pytest-asyncio \
  pytest-aiohttp pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection \
  typing-extensions
ls .whl
