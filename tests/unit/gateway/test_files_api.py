"""`/v1/files` on the real gateway app (no workers needed), over raw HTTP and the `openai` SDK."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio

from accounting.file_store import InvalidKeyError, LocalFileStore, MissingObjectError
from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.state import SETTINGS
from tests.unit.gateway.test_gateway_api import make_tenant_key

GOOD = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}).encode()
                + b"\n" for i in range(3))


@pytest_asyncio.fixture
async def gateway(aiohttp_client, tmp_path: Path):
    """(client, acme's auth headers, globex's auth headers, acme's key)."""
    url = f"sqlite:///{tmp_path}/tollway.db"
    _, acme = make_tenant_key(url, "acme")
    _, globex = make_tenant_key(url, "globex")
    settings = GatewaySettings(home=tmp_path, worker_urls="http://127.0.0.1:9", admin_key="k")
    client = await aiohttp_client(create_app(settings))
    return client, {"Authorization": f"Bearer {acme}"}, {"Authorization": f"Bearer {globex}"}, acme


def form(data: bytes | None = GOOD, purpose: str | None = "batch", filename: str = "in.jsonl") -> aiohttp.FormData:
    body = aiohttp.FormData()
    if purpose is not None:
        body.add_field("purpose", purpose)
    if data is not None:
        body.add_field("file", data, filename=filename, content_type="application/jsonl")
    return body


async def upload(client, headers, **kwargs) -> aiohttp.ClientResponse:
    return await client.post("/v1/files", data=form(**kwargs), headers=headers)


@pytest.mark.asyncio
async def test_upload_list_retrieve_content_delete(gateway, tmp_path: Path) -> None:
    client, acme, _, _ = gateway
    response = await upload(client, acme)
    assert response.status == 200, await response.text()
    created = await response.json()
    assert created["id"].startswith("file-") and len(created["id"]) == 5 + 24
    assert created | {"id": "", "created_at": 0} == {
        "id": "", "object": "file", "bytes": len(GOOD), "created_at": 0, "filename": "in.jsonl",
        "purpose": "batch", "status": "processed", "status_details": None}
    file_id = created["id"]
    assert len(list((tmp_path / "files").rglob("file-*"))) == 1

    assert await (await client.get(f"/v1/files/{file_id}", headers=acme)).json() == created
    content = await client.get(f"/v1/files/{file_id}/content", headers=acme)
    assert content.status == 200 and await content.read() == GOOD
    listing = await (await client.get("/v1/files", headers=acme)).json()
    assert listing["object"] == "list" and listing["data"] == [created] and listing["has_more"] is False

    deleted = await client.delete(f"/v1/files/{file_id}", headers=acme)
    assert await deleted.json() == {"id": file_id, "object": "file", "deleted": True}
    assert not list((tmp_path / "files").rglob("file-*"))
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content"):
        response = await client.get(path, headers=acme)
        assert response.status == 404 and (await response.json())["error"]["code"] == "file_not_found"
    assert (await client.delete(f"/v1/files/{file_id}", headers=acme)).status == 404
    assert (await (await client.get("/v1/files", headers=acme)).json())["data"] == []


@pytest.mark.asyncio
async def test_another_tenants_file_is_not_found(gateway) -> None:
    client, acme, globex, _ = gateway
    file_id = (await (await upload(client, acme)).json())["id"]
    for method, path in (("GET", f"/v1/files/{file_id}"), ("GET", f"/v1/files/{file_id}/content"),
                         ("DELETE", f"/v1/files/{file_id}")):
        assert (await client.request(method, path, headers=globex)).status == 404
    assert (await (await client.get("/v1/files", headers=globex)).json())["data"] == []
    assert (await client.get(f"/v1/files/{file_id}", headers=acme)).status == 200  # untouched
    for headers in ({}, {"Authorization": "Bearer k"}):
        assert (await client.get(f"/v1/files/{file_id}", headers=headers)).status == 401
        assert (await upload(client, headers)).status == 401


@pytest.mark.asyncio
async def test_listing_pages_and_filters(gateway) -> None:
    client, acme, _, _ = gateway
    ids = [(await (await upload(client, acme)).json())["id"] for _ in range(3)]
    page = await (await client.get("/v1/files", params={"limit": "2"}, headers=acme)).json()
    assert [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = await (await client.get("/v1/files", params={"limit": "2", "after": page["last_id"]},
                                   headers=acme)).json()
    assert [f["id"] for f in rest["data"]] == ids[:1] and rest["has_more"] is False
    ascending = await (await client.get("/v1/files", params={"order": "asc"}, headers=acme)).json()
    assert [f["id"] for f in ascending["data"]] == ids
    assert (await (await client.get("/v1/files", params={"purpose": "batch_output"}, headers=acme)).json())[
        "data"] == []
    for params in ({"limit": "0"}, {"limit": "x"}, {"order": "up"}, {"purpose": "nope"}, {"after": "file-x"}):
        assert (await client.get("/v1/files", params=params, headers=acme)).status == 400


@pytest.mark.asyncio
async def test_invalid_batch_input_names_the_lines(gateway, tmp_path: Path) -> None:
    client, acme, _, _ = gateway
    bad = GOOD + b"{oops\n" + GOOD.splitlines()[0] + b"\n"
    response = await upload(client, acme, data=bad)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "invalid_batch_input" and error["param"] == "file"
    assert "line 4: not valid JSON" in error["message"]
    assert "line 5: duplicate custom_id 'r0' (first on line 1)" in error["message"]
    assert not (tmp_path / "files").exists() or not list((tmp_path / "files").rglob("file-*"))
    assert (await upload(client, acme, data=b"\n")).status == 400


@pytest.mark.asyncio
async def test_bad_uploads(gateway) -> None:
    client, acme, _, _ = gateway
    for kwargs, param in (({"purpose": "fine-tune"}, "purpose"), ({"purpose": "batch_output"}, "purpose"),
                          ({"data": None}, "file"), ({"purpose": None}, "purpose")):
        response = await upload(client, acme, **kwargs)
        assert response.status == 400, kwargs
        assert (await response.json())["error"]["param"] == param
    response = await client.post("/v1/files", json={"purpose": "batch"}, headers=acme)
    assert response.status == 400


@pytest.mark.asyncio
async def test_oversize_upload_is_413(gateway, monkeypatch) -> None:
    client, acme, _, _ = gateway
    monkeypatch.setattr(client.app[SETTINGS], "max_file_bytes", len(GOOD) - 1)
    response = await upload(client, acme)
    assert response.status == 413 and (await response.json())["error"]["code"] == "file_too_large"
    monkeypatch.setattr(client.app[SETTINGS], "max_file_bytes", len(GOOD))
    assert (await upload(client, acme)).status == 200
    # Far more than the limit: refused without reading the rest, and the client still gets the 413.
    response = await upload(client, acme, data=GOOD * 20_000)
    assert response.status == 413


@pytest.mark.asyncio
async def test_uploads_may_exceed_the_json_body_limit(gateway) -> None:
    """client_max_size (4 MiB by default) caps JSON bodies, not streamed file uploads."""
    client, acme, _, _ = gateway
    line = GOOD.splitlines()[0]
    big = b"".join(line.replace(b'"r0"', f'"big{i}"'.encode()) + b" " * 1000 + b"\n" for i in range(5000))
    assert len(big) > client.app._client_max_size
    response = await upload(client, acme, data=big)
    assert response.status == 200, await response.text()
    file_id = (await response.json())["id"]
    assert await (await client.get(f"/v1/files/{file_id}/content", headers=acme)).read() == big


@pytest.mark.asyncio
async def test_the_openai_sdk(gateway) -> None:
    client, _, globex, key = gateway
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)
    other = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=globex["Authorization"][7:],
                               max_retries=0)
    created = await sdk.files.create(file=("in.jsonl", GOOD), purpose="batch")
    assert created.id.startswith("file-") and created.bytes == len(GOOD) and created.purpose == "batch"
    assert (await sdk.files.retrieve(created.id)).filename == "in.jsonl"
    assert (await sdk.files.content(created.id)).read() == GOOD
    assert [f.id async for f in sdk.files.list()] == [created.id]
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.files.create(file=("bad.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
    assert "line 1" in info.value.message
    with pytest.raises(openai.NotFoundError):
        await other.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        await other.files.delete(created.id)
    deleted = await sdk.files.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    with pytest.raises(openai.NotFoundError):
        await sdk.files.retrieve(created.id)
    await sdk.close()
    await other.close()


def test_the_local_store(tmp_path: Path) -> None:
    store = LocalFileStore(tmp_path / "files")
    store.put("1/file-abc", b"one")
    store.put("1/file-abc", b"two")  # replaced atomically; no temporary file is left behind
    assert store.get("1/file-abc") == b"two"
    assert [p.name for p in (tmp_path / "files" / "1").iterdir()] == ["file-abc"]
    store.delete("1/file-abc")
    store.delete("1/file-abc")  # idempotent
    with pytest.raises(MissingObjectError):
        store.get("1/file-abc")
    for key in ("../x", "/etc/passwd", "1/../../x", "..", "1/.hidden", "a\\b", "", "a//b"):
        with pytest.raises(InvalidKeyError):
            store.put(key, b"x")
