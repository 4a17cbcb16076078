"""`tollway up`'s supervisor: it announces the URL only once the gateway's /readyz answers 200,
printing what is still missing meanwhile; its gateway and workers share one worker secret."""

from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from ops import supervisor
from ops.supervisor import Supervisor, plan_children, readiness
from tests.net import free_port


class Gateway:
    """A stand-in gateway on a thread: /readyz answers 503 `not_ready` `not_ready_for` times, then 200."""

    def __init__(self, not_ready_for: int) -> None:
        self.not_ready_for = not_ready_for
        self.calls: list[str] = []
        gateway = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                gateway.calls.append(self.path)
                ready = len(gateway.calls) > gateway.not_ready_for
                body = {"status": "ready" if ready else "not_ready", "workers_healthy": int(ready),
                        "workers_total": 1}
                data = json.dumps(body).encode()
                self.send_response(200 if ready else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/readyz"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "READY_POLL_S", 0.01)
    monkeypatch.setattr(supervisor, "PROGRESS_EVERY_S", 0.05)


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    server = Gateway(not_ready_for=20)
    yield server
    server.close()


def test_readiness_says_what_is_missing() -> None:
    assert readiness(f"http://127.0.0.1:{free_port()}/readyz") == (False, "the gateway is not answering yet")
    server = Gateway(not_ready_for=1)
    try:
        assert readiness(server.url) == (False, "0 of 1 engine workers in rotation")
        assert readiness(server.url) == (True, "ready")
    finally:
        server.close()


def test_it_waits_for_readyz_and_prints_progress_meanwhile(fast: None, gateway: Gateway, tmp_path: Path) -> None:
    out = io.StringIO()
    tended = Supervisor([], Console(file=out, width=200))
    assert tended.wait_ready(gateway.url, tmp_path / "logs")
    assert len(gateway.calls) == 21 and set(gateway.calls) == {"/readyz"}  # until the first 200, not after
    progress = [line for line in out.getvalue().splitlines() if line.startswith("still starting")]
    assert progress and all("0 of 1 engine workers in rotation" in line and str(tmp_path / "logs") in line
                            for line in progress)


def test_a_stop_while_waiting_announces_nothing(fast: None, gateway: Gateway, tmp_path: Path) -> None:
    tended = Supervisor([], Console(file=io.StringIO()))
    tended.stopping = True
    assert not tended.wait_ready(gateway.url, tmp_path)


def test_the_gateway_and_the_workers_get_the_same_worker_secret(tmp_path: Path) -> None:
    children = {child.name: child for child in plan_children(tmp_path, 8000, 2, 8100, "tw-worker-s3cret")}
    for name in ("gateway", "worker-0", "worker-1"):
        assert children[name].env["TOLLWAY_WORKER_SECRET"] == "tw-worker-s3cret"
    assert children["gateway"].env["TOLLWAY_WORKER_URLS"] == "http://127.0.0.1:8100,http://127.0.0.1:8101"
    assert "--host" not in children["worker-0"].argv  # workers bind their default, 127.0.0.1


def test_up_passes_its_quantization_to_the_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLWAY_QUANTIZATION", "int8")
    inherited = {c.name: c for c in plan_children(tmp_path, 8000, 1, 8100, "s")}
    assert inherited["worker-0"].env["TOLLWAY_QUANTIZATION"] == "int8"  # the environment reaches workers
    chosen = {c.name: c for c in plan_children(tmp_path, 8000, 1, 8100, "s", quantization="int4")}
    assert chosen["worker-0"].env["TOLLWAY_QUANTIZATION"] == "int4"  # `up --quantization` overrides it
