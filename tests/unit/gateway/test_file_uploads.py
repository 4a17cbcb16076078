"""`POST /v1/files` streams the upload to disk chunk by chunk under the size limit, within time limits
(an idle read, a whole upload), then checks it from disk and adopts it into the store; a staged file
never outlives its request, whatever the outcome."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from accounting.file_store import STAGING, LocalFileStore
from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.unit.gateway.test_files_api import GOOD
from tests.unit.gateway.test_gateway_api import make_tenant_key

pytestmark = pytest.mark.asyncio
BOUNDARY = "tollwayboundary"
HEAD = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
        f"Content-Type: application/jsonl\r\n\r\n").encode()
TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()


@pytest_asyncio.fixture
async def gateway(aiohttp_client, tmp_path: Path):
    """(client, auth headers, the staging folder): 1 s idle reads, 3 s per upload, 64 KiB lines."""
    _, key = make_tenant_key(f"sqlite:///{tmp_path}/tollway.db", "acme")
    settings = GatewaySettings(home=tmp_path, worker_urls="http://127.0.0.1:9", admin_key="k", read_timeout_s=1.0,
                               upload_timeout_s=3.0, max_body_mb=1 / 16, max_file_bytes=2**20)
    client = await aiohttp_client(create_app(settings))
    return client, {"Authorization": f"Bearer {key}"}, tmp_path / "files" / STAGING


def multipart(*chunks: bytes, pause_s: float = 0.0, paused: asyncio.Event | None = None,
              resume: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    """The body in pieces, `pause_s` apart; with `paused`/`resume`, it also stops after the fourth
    piece until `resume` is set."""

    async def body() -> AsyncIterator[bytes]:
        yield HEAD
        for i, chunk in enumerate(chunks):
            yield chunk
            await asyncio.sleep(pause_s)
            if paused is not None and resume is not None and i == 3:
                paused.set()
                await resume.wait()
        yield TAIL

    return body()


async def post(client, auth, body) -> tuple[int, dict]:
    response = await client.post("/v1/files", data=body,
                                 headers={**auth, "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    return response.status, await response.json()


def staged(folder: Path) -> list[Path]:
    return sorted(folder.glob("upload-*")) if folder.exists() else []


async def test_the_upload_is_on_disk_while_it_arrives_and_adopted_after(gateway) -> None:
    client, auth, staging = gateway
    paused, resume = asyncio.Event(), asyncio.Event()
    pieces = [GOOD[i:i + 60] for i in range(0, 240, 60)] + [GOOD[240:]]
    upload = asyncio.create_task(post(client, auth, multipart(*pieces, pause_s=0.2, paused=paused, resume=resume)))
    await paused.wait()
    # The multipart reader hands a chunk over once bytes after it have come (to find the boundary):
    # the first pieces are in the staged file while the last ones have not even been sent.
    async with asyncio.timeout(0.5):  # within the 1 s idle limit
        while not staged(staging) or staged(staging)[0].stat().st_size < 60:
            await asyncio.sleep(0.01)
    on_disk = staged(staging)[0].read_bytes()
    assert len(on_disk) < len(GOOD) and GOOD.startswith(on_disk)
    resume.set()
    status, body = await upload
    assert status == 200 and body["bytes"] == len(GOOD), body
    assert staged(staging) == []  # adopted: renamed into the store
    assert LocalFileStore(staging.parent).get(f"1/{body['id']}") == GOOD


async def test_a_stalled_upload_gets_a_408_and_leaves_nothing(gateway) -> None:
    client, auth, staging = gateway
    started = asyncio.get_running_loop().time()
    status, body = await post(client, auth, multipart(GOOD[:50], GOOD[50:], pause_s=5.0))
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert asyncio.get_running_loop().time() - started < 4  # the 1 s idle limit, not the 5 s stall
    assert staged(staging) == []


async def test_an_upload_that_trickles_past_the_deadline_gets_a_408(gateway) -> None:
    client, auth, staging = gateway
    trickle = [GOOD[i:i + 20] for i in range(0, len(GOOD), 20)]  # always progressing, never done in 3 s
    status, body = await post(client, auth, multipart(*trickle, pause_s=0.3))
    assert status == 408 and "in time" in body["error"]["message"]
    assert staged(staging) == []


async def test_too_large_or_invalid_uploads_are_refused_and_leave_nothing(gateway) -> None:
    client, auth, staging = gateway
    status, body = await post(client, auth, multipart(b"x" * (2**20 + 1)))
    assert status == 413 and body["error"]["code"] == "file_too_large"
    long_line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                            "body": {"model": "m", "prompt": "x" * 2**16}}).encode()
    status, body = await post(client, auth, multipart(GOOD + long_line + b"\n"))
    assert status == 400 and body["error"]["code"] == "invalid_batch_input"
    assert "line 4: longer than the largest request body" in body["error"]["message"]
    status, body = await post(client, auth, multipart(b'{"custom_id": "a"}\n'))
    assert status == 400 and "line 1" in body["error"]["message"]
    assert staged(staging) == [] and not list((staging.parent).rglob("file-*"))
