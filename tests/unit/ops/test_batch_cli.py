"""`tollway batch …` against a whole system in this process: the real gateway app and a fake worker
served on local ports from a background event loop, with batch steps (workers/jobs/runner.py) run
inline on that loop where Celery would run them."""

from __future__ import annotations

import asyncio
import faulthandler
import io
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from click.testing import CliRunner

from accounting.db import create_db_engine, session_factory
from accounting.file_store import LocalFileStore
from gateway.app import create_app
from gateway.batches.dispatch import BATCH_DISPATCHER
from gateway.settings import GatewaySettings
from gateway.state import POOL
from ops.cli import cli
from ops.fake_worker import FAKE_WORKER_SECRET, FakeWorker, create_fake_worker_app
from tests.net import free_port
from tests.unit.gateway.test_batches_api import ADMIN
from tests.unit.gateway.test_gateway_api import MODEL, make_tenant_key
from workers.jobs.runner import BatchStep, RunnerConfig


class InlineRunner:
    """A dispatcher that runs the batch's steps on the system's loop until it ends.

    `stop()` cancels the batches still running: Celery's runner lives in its own process, so one left
    here would share the gateway's loop and thread pool while the gateway shuts down (a test that
    ends before its batch would then time its teardown against the runner's retries)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, home: Path, gateway_url: str) -> None:
        self.loop, self.gateway_url = loop, gateway_url
        self.sessions = session_factory(create_db_engine(f"sqlite:///{home}/tollway.db"))
        self.store = LocalFileStore(home / "files")
        self.running: set[asyncio.Task[None]] = set()

    def dispatch(self, batch_id: str) -> None:
        asyncio.run_coroutine_threadsafe(self._start(batch_id), self.loop)

    async def _start(self, batch_id: str) -> None:
        task = asyncio.create_task(self._run(batch_id))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def stop(self) -> None:
        for task in list(self.running):
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)

    async def _run(self, batch_id: str) -> None:
        config = RunnerConfig(gateway_url=self.gateway_url, admin_key=ADMIN, concurrency=4)
        for step in range(100):
            if await BatchStep(batch_id, f"inline-{step}", self.sessions, self.store, config).run() != "continue":
                return


@dataclass
class System:
    url: str
    key: str
    other_key: str


@pytest.fixture
def system(tmp_path: Path) -> Iterator[System]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    db_url = f"sqlite:///{tmp_path}/tollway.db"
    _, key = make_tenant_key(db_url, "acme")
    _, other = make_tenant_key(db_url, "globex")
    worker_port, gateway_port = free_port(), free_port()
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    runners: list[web.AppRunner] = []
    batches = InlineRunner(loop, tmp_path, gateway_url)

    async def start() -> None:
        worker = web.AppRunner(create_fake_worker_app(FakeWorker(context_length=256, delay_s=0.01)))
        await worker.setup()
        await web.TCPSite(worker, "127.0.0.1", worker_port).start()
        settings = GatewaySettings(home=tmp_path, worker_secret=FAKE_WORKER_SECRET, worker_urls=f"http://127.0.0.1:{worker_port}", admin_key=ADMIN,
                                   health_interval_s=0.2)
        app = create_app(settings)
        app[BATCH_DISPATCHER] = batches
        gateway = web.AppRunner(app)
        await gateway.setup()
        await web.TCPSite(gateway, "127.0.0.1", gateway_port).start()
        runners.extend([gateway, worker])
        for _ in range(100):  # until the gateway knows the worker's model
            if app[POOL].models:
                return
            await asyncio.sleep(0.05)

    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield System(gateway_url, key, other)
    finally:
        async def stop() -> None:
            await batches.stop()
            for runner in runners:
                await runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        except TimeoutError:  # say where it hangs: the loop's tasks and every thread's stack
            stacks = io.StringIO()
            for task in asyncio.all_tasks(loop):
                task.print_stack(file=stacks)
            with open(tmp_path / "threads.txt", "w+") as threads:
                faulthandler.dump_traceback(threads)
                threads.seek(0)
                stacks.write(threads.read())
            raise TimeoutError(f"stopping the gateway and the worker took over 30 s:\n{stacks.getvalue()}") from None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def input_file(path: Path, lines: int) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"model": MODEL, "prompt": f"say {i}", "max_tokens": 4}}) + "\n"
                            for i in range(lines)))
    return path


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_submit_wait_shows_progress_and_saves_the_output(system: System, tmp_path: Path) -> None:
    source = input_file(tmp_path / "in.jsonl", 25)
    result = invoke("batch", "submit", str(source), "--api-key", system.key, "--gateway-url", system.url,
                    "--wait", "--output-dir", str(tmp_path / "out"), "--metadata", "team=search")
    assert result.exit_code == 0, result.output
    batch_id = result.stdout.strip()
    assert batch_id.startswith("batch_")
    assert "25 completed, 0 failed / 25" in result.output and "tokens/s" in result.output
    saved = tmp_path / "out" / f"{batch_id}_output.jsonl"
    assert f"saved {saved}" in result.output.replace("\n", "")
    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"q{i}" for i in range(25))
    assert all(line["response"]["body"]["object"] == "text_completion" for line in lines)

    status = invoke("batch", "status", batch_id, "--api-key", system.key, "--gateway-url", system.url, "--json")
    assert json.loads(status.stdout)["status"] == "completed"
    listed = invoke("batch", "list", "--api-key", system.key, "--gateway-url", system.url)
    assert batch_id in listed.stdout and "completed" in listed.stdout
    again = invoke("batch", "download", batch_id, "--api-key", system.key, "--gateway-url", system.url,
                   "--output-dir", str(tmp_path / "again"))
    assert again.exit_code == 0 and (tmp_path / "again" / saved.name).read_bytes() == saved.read_bytes()
    refused = invoke("batch", "cancel", batch_id, "--api-key", system.key, "--gateway-url", system.url)
    assert refused.exit_code == 1 and "HTTP 409" in refused.output
    hidden = invoke("batch", "status", batch_id, "--api-key", system.other_key, "--gateway-url", system.url)
    assert hidden.exit_code == 1 and "HTTP 404" in hidden.output  # another tenant's batch


def test_submit_without_wait_prints_the_id_and_errors_are_clear(system: System, tmp_path: Path) -> None:
    source = input_file(tmp_path / "in.jsonl", 2)
    result = invoke("batch", "submit", str(source), "--api-key", system.key, "--gateway-url", system.url)
    assert result.exit_code == 0 and result.stdout.strip().startswith("batch_")
    bad_key = invoke("batch", "list", "--api-key", "tw-nope", "--gateway-url", system.url)
    assert bad_key.exit_code == 1 and "HTTP 401" in bad_key.output
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    invalid = invoke("batch", "submit", str(tmp_path / "bad.jsonl"), "--api-key", system.key,
                     "--gateway-url", system.url)
    assert invalid.exit_code == 1 and "line 1: not valid JSON" in invalid.output
    down = invoke("batch", "list", "--api-key", system.key, "--gateway-url", f"http://127.0.0.1:{free_port()}")
    assert down.exit_code == 1 and "cannot reach the gateway" in down.output
    missing = CliRunner().invoke(cli, ["batch", "submit", str(tmp_path / "nope.jsonl"), "--api-key", "k"])
    assert missing.exit_code == 2
