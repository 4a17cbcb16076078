"""OpenAI's Files API, scoped to the caller's tenant (a tenant API key):

- `POST /v1/files` (multipart: `file`, `purpose=batch`), validated as a batch input file
- `GET /v1/files[?purpose=&limit=&after=&order=]`, `GET /v1/files/{file_id}`,
  `GET /v1/files/{file_id}/content`, `DELETE /v1/files/{file_id}`

Another tenant's file answers 404, like an id that never existed. Views are thin: metadata work is
done by `accounting.files` in one transaction per request in a worker thread; bytes go to the app's
`FileStore` (by default a `LocalFileStore` under `$TOLLWAY_HOME/files`).

Upload size: the app's `client_max_size` (TOLLWAY_MAX_BODY_MB) caps `request.read()`/`post()` and
each multipart `part.read()`, but not `part.read_chunk()`. Uploads are therefore read chunk by chunk
here and capped by `TOLLWAY_MAX_FILE_BYTES` instead (413 beyond it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import BodyPartReader, web
from sqlalchemy.orm import Session

from accounting import files
from accounting.batch_input import BatchInputError, validate_batch_input
from accounting.file_store import FileStore, LocalFileStore
from gateway.api.body import query_int
from gateway.api.errors import ApiError, invalid
from gateway.api.transactions import in_transaction
from gateway.auth.guards import CALLER, tenant
from gateway.state import SETTINGS

MAX_FIELD_BYTES = 1024
"""Cap of the small form fields (`purpose`)."""

FILE_STORE = web.AppKey("file_store", FileStore)  # type: ignore[type-abstract]
"""Optional: an app may set its own store (S3 later, tests) before it starts."""


def file_store(app: web.Application) -> FileStore:
    """The app's store: `app[FILE_STORE]` if set, else the local store under the home folder.

    The local store holds no state (just a root path), so it is built per call rather than cached
    on the app: setting app keys once the app runs is deprecated in aiohttp.
    """
    store = app.get(FILE_STORE)
    return store if store is not None else LocalFileStore(app[SETTINGS].home / "files")


async def _read_part(part: BodyPartReader, limit: int, name: str) -> bytes:
    """The part's bytes, chunk by chunk; more than `limit` → 413 (the rest is not read)."""
    data = bytearray()
    while chunk := await part.read_chunk():
        data.extend(chunk)
        if len(data) > limit:
            raise ApiError(413, f"'{name}' is larger than {limit} bytes", param=name, code="file_too_large")
    return bytes(data)


async def _read_upload(request: web.Request) -> tuple[str, str, bytes]:
    """(filename, purpose, bytes) of a multipart upload; unknown fields are drained and ignored."""
    if not request.content_type.startswith("multipart/"):
        raise invalid("upload the file as multipart/form-data with fields 'file' and 'purpose'", "file")
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as exc:  # no/invalid boundary
        raise invalid(f"malformed multipart body: {exc}") from exc
    filename: str | None = None
    purpose: str | None = None
    data: bytes | None = None
    try:
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):  # a nested multipart: not part of the API
                raise invalid("nested multipart bodies are not supported")
            if part.name == "file" and data is None:
                filename = part.filename or "upload.jsonl"
                data = await _read_part(part, request.app[SETTINGS].max_file_bytes, "file")
            elif part.name == "purpose" and purpose is None:
                purpose = (await _read_part(part, MAX_FIELD_BYTES, "purpose")).decode("utf-8", "replace")
            else:
                await part.release()
    except ValueError as exc:  # the multipart parser's own errors
        raise invalid(f"malformed multipart body: {exc}") from exc
    if data is None or filename is None:
        raise invalid("the 'file' field is required", "file")
    if purpose is None:
        raise invalid("the 'purpose' field is required", "purpose")
    return filename, purpose.strip(), data


@tenant
async def upload_file(request: web.Request) -> web.Response:
    """Upload a file (multipart: file, purpose=batch); batch input files are validated line by line."""
    tenant_id = request[CALLER].tenant_id
    filename, purpose, data = await _read_upload(request)
    if purpose not in files.USER_PURPOSES:
        raise invalid(f"purpose must be one of {', '.join(files.USER_PURPOSES)}, got {purpose!r}", "purpose")
    try:
        # CPU work on up to max_file_bytes: off the event loop.
        settings = request.app[SETTINGS]
        await asyncio.to_thread(validate_batch_input, data, max_lines=settings.max_batch_lines,
                                max_bytes=settings.max_file_bytes)
    except BatchInputError as exc:
        raise invalid(str(exc), "file", code="invalid_batch_input") from exc
    store = file_store(request.app)
    created: list[str] = []

    def work(session: Session) -> dict[str, Any]:
        row = files.create_file(session, store, tenant_id, filename, purpose, data)
        created.append(row.storage_key)
        return files.file_to_dict(row)

    try:
        body = await in_transaction(request, work, not_found_param="file_id")
    except BaseException:
        # The row was not committed: its bytes must not linger in the store.
        for key in created:
            await asyncio.to_thread(store.delete, key)
        raise
    return web.json_response(body)


@tenant
async def list_files(request: web.Request) -> web.Response:
    """List your tenant's files, newest first (?purpose=, ?limit=, ?after=FILE_ID, ?order=asc|desc)."""
    tenant_id = request[CALLER].tenant_id
    purpose = request.query.get("purpose") or None
    limit = query_int(request, "limit", files.MAX_LIST_LIMIT)
    after = request.query.get("after") or None
    order = request.query.get("order", "desc")

    def work(session: Session) -> tuple[list[dict[str, Any]], bool]:
        rows, more = files.list_files(session, tenant_id, purpose, limit=limit, after=after, order=order)
        return [files.file_to_dict(f) for f in rows], more

    data, has_more = await in_transaction(request, work, not_found_param="file_id")
    return web.json_response({"object": "list", "data": data, "has_more": has_more,
                              "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None})


@tenant
async def retrieve_file(request: web.Request) -> web.Response:
    """Retrieve one of your tenant's files (its metadata)."""
    tenant_id = request[CALLER].tenant_id
    file_id = request.match_info["file_id"]
    row = await in_transaction(request, lambda s: files.file_to_dict(files.get_file(s, tenant_id, file_id)),
                               not_found_param="file_id")
    return web.json_response(row)


@tenant
async def file_content(request: web.Request) -> web.Response:
    """Download the bytes of one of your tenant's files."""
    tenant_id = request[CALLER].tenant_id
    file_id = request.match_info["file_id"]
    store = file_store(request.app)
    data = await in_transaction(request, lambda s: files.read_file_content(s, store, tenant_id, file_id),
                                not_found_param="file_id")
    return web.Response(body=data, content_type="application/octet-stream")


@tenant
async def delete_file(request: web.Request) -> web.Response:
    """Delete one of your tenant's files (its bytes are removed; the record is kept, marked deleted)."""
    tenant_id = request[CALLER].tenant_id
    file_id = request.match_info["file_id"]
    row = await in_transaction(request, lambda s: files.delete_file(s, tenant_id, file_id),
                               not_found_param="file_id")
    await asyncio.to_thread(file_store(request.app).delete, row.storage_key)  # after the commit
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


def add_routes(router: web.UrlDispatcher) -> None:
    """Register the Files API routes."""
    router.add_post("/v1/files", upload_file)
    router.add_get("/v1/files", list_files)
    router.add_get("/v1/files/{file_id}", retrieve_file)
    router.add_get("/v1/files/{file_id}/content", file_content)
    router.add_delete("/v1/files/{file_id}", delete_file)
