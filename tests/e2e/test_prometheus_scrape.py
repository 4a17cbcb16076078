"""Debian's real Prometheus scrapes a real `tollway up` (gateway + an engine worker on the default
model) with ops/deploy/prometheus.yml, pointed at this machine; its HTTP API must then return
`tollway_` series from both, with the values the traffic made.

Skips when /usr/bin/prometheus is absent (ops/test installs Debian's package as root with apt).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.e2e.tollway_up import start_tollway
from tests.net import free_port
from tests.required import require_executable

PROMETHEUS = Path(os.environ.get("TOLLWAY_PROMETHEUS", "/usr/bin/prometheus"))
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def prometheus_present() -> None:
    require_executable(PROMETHEUS, "install Debian's prometheus (ops/test does, as root)")
MODEL = "smollm2-135m-instruct"


def scrape_config(shipped: dict, gateway: str, worker: str, key_file: Path) -> dict:
    """ops/deploy/prometheus.yml with its targets replaced by this machine's processes."""
    config = {**shipped, "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}}
    jobs = {job["job_name"]: dict(job) for job in shipped["scrape_configs"]}
    gateway_job, worker_job = jobs["tollway-gateway"], jobs["tollway-worker"]
    gateway_job.pop("dns_sd_configs")
    gateway_job["static_configs"] = [{"targets": [gateway]}]
    gateway_job["authorization"] = {**gateway_job["authorization"], "credentials_file": str(key_file)}
    worker_job["static_configs"] = [{"targets": [worker]}]
    config["scrape_configs"] = [gateway_job, worker_job]
    return config


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(port: int, promql: str, ready, timeout_s: float = 60.0) -> list[dict]:
    deadline, result = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        try:
            result = query(port, promql)
            if ready(result):
                return result
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{promql!r} never became ready: {result}")


def test_prometheus_scrapes_tollway_series_from_the_gateway_and_a_worker(
        smollm2_folder: Path, model_home: Path, tmp_path: Path) -> None:
    tollway = start_tollway(tmp_path / "home", model_home, TOLLWAY_DTYPE="float32")
    prometheus = None
    try:
        client = openai.OpenAI(base_url=f"{tollway.base_url}/v1", api_key=tollway.new_key("acme"), max_retries=0)
        for _ in range(2):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=4)
        key_file = tmp_path / "admin.key"
        shutil.copy(tollway.home / "admin.key", key_file)
        shipped = yaml.safe_load((REPO_ROOT / "ops" / "deploy" / "prometheus.yml").read_text())
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(shipped, f"127.0.0.1:{tollway.port}",
                                                       f"127.0.0.1:{tollway.worker_port}", key_file)))
        port = free_port()
        prometheus = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"))

        up = wait_for(port, "up", lambda r: len(r) == 2 and all(s["value"][1] == "1" for s in r))
        assert {s["metric"]["job"] for s in up} == {"tollway-gateway", "tollway-worker"}  # the admin key worked
        series = wait_for(port, 'count by (job) ({__name__=~"tollway_.+"})', lambda r: len(r) == 2)
        assert all(int(s["value"][1]) >= 5 for s in series)
        [requests] = query(port, f'tollway_requests_total{{tenant="acme",model="{MODEL}",status="200"}}')
        assert requests["value"][1] == "2" and requests["metric"]["job"] == "tollway-gateway"
        [tokens] = query(port, "tollway_completion_tokens_total")
        [worker_tokens] = query(port, "tollway_worker_completion_tokens_total")
        assert tokens["value"][1] == worker_tokens["value"][1] and 0 < int(tokens["value"][1]) <= 8
        [total_blocks] = query(port, 'tollway_worker_kv_blocks{state="total"}')
        assert int(total_blocks["value"][1]) > 0 and total_blocks["metric"]["job"] == "tollway-worker"
        [ttft] = query(port, "tollway_time_to_first_token_seconds_count")
        assert ttft["value"][1] == "2"
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        tollway.stop()
