"""OpenAI's Files API, scoped to the caller's tenant (a tenant API key):

- `POST /v1/files` (multipart: `file`, `purpose=batch`), validated as a batch input file
- `GET /v1/files[?purpose=&limit=&after=&order=]`, `GET /v1/files/{file_id}`,
  `GET /v1/files/{file_id}/content`, `DELETE /v1/files/{file_id}`

Another tenant's file answers 404, like an id that never existed. Views are thin: metadata work is
done by `accounting.files` in one transaction per request in a worker thread; bytes go to the app's
`FileStore` (by default a `LocalFileStore` under `$TOLLWAY_HOME/files`).

Uploads never sit in memory: the `file` part is streamed chunk by chunk into a file in the store's
staging folder (`FileStore.staging_folder()`), capped by TOLLWAY_MAX_FILE_BYTES (413 beyond it: the
app's `client_max_size` caps `part.read()` but not `part.read_chunk()`), then checked line by line
from disk (`check_batch_input_file`) and adopted by the store (a rename for the local store). The
staged file is removed whatever happens. Reading is bounded in time: a client that sends nothing
for TOLLWAY_READ_TIMEOUT_S, or has not finished within TOLLWAY_UPLOAD_TIMEOUT_S, gets a 408.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web
from sqlalchemy.orm import Session

from accounting import files
from accounting.batch_input import BatchInputError, check_batch_input_file
from accounting.file_store import FileStore, LocalFileStore
from gateway.api.body import query_int
from gateway.api.errors import ApiError, invalid
from gateway.api.transactions import in_transaction
from gateway.auth.guards import CALLER, tenant
from gateway.state import SETTINGS

MAX_FIELD_BYTES = 1024
"""Cap of the small form fields (`purpose`)."""
MAX_PARTS = 16
"""Most multipart parts read (unknown ones are drained); more is a 400."""
UPLOAD_CHUNK = 256 * 2**10

FILE_STORE = web.AppKey("file_store", FileStore)  # type: ignore[type-abstract]
"""Optional: an app may set its own store (S3 later, tests) before it starts."""


def file_store(app: web.Application) -> FileStore:
    """The app's store: `app[FILE_STORE]` if set, else the local store under the home folder.

    The local store holds no state (just a root path), so it is built per call rather than cached
    on the app: setting app keys once the app runs is deprecated in aiohttp.
    """
    store = app.get(FILE_STORE)
    return store if store is not None else LocalFileStore(app[SETTINGS].home / "files")


class _Idle:
    """Each read of the body must make progress within `seconds` (TimeoutError otherwise)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def read(self, part: BodyPartReader, size: int) -> bytes:
        async with asyncio.timeout(self.seconds):
            return await part.read_chunk(size)


def _too_large(name: str, limit: int) -> ApiError:
    return ApiError(413, f"'{name}' is larger than {limit} bytes", param=name, code="file_too_large")


async def _read_field(part: BodyPartReader, limit: int, name: str, idle: _Idle) -> bytes:
    """A small part's bytes; more than `limit` → 413 (the rest is not read)."""
    data = bytearray()
    while chunk := await idle.read(part, limit + 1):
        data.extend(chunk)
        if len(data) > limit:
            raise _too_large(name, limit)
    return bytes(data)


async def _stage_part(part: BodyPartReader, limit: int, folder: Path, idle: _Idle) -> Path:
    """The part streamed into a new file in `folder`, chunk by chunk (never all in memory); more
    than `limit` bytes → 413, and the file is removed on any failure."""
    fd, name = tempfile.mkstemp(dir=folder, prefix="upload-", suffix=".part")
    path = Path(name)
    size = 0
    try:
        with os.fdopen(fd, "wb", buffering=0) as out:  # each chunk straight to the file
            while chunk := await idle.read(part, UPLOAD_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise _too_large("file", limit)
                await asyncio.to_thread(out.write, chunk)  # off the event loop: the disk may be slow
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


async def _read_upload(request: web.Request, staging: Path) -> tuple[str, str, Path]:
    """(filename, purpose, the staged file) of a multipart upload; unknown fields are drained and
    ignored. The caller owns (and removes) the staged file."""
    if not request.content_type.startswith("multipart/"):
        raise invalid("upload the file as multipart/form-data with fields 'file' and 'purpose'", "file")
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as exc:  # no/invalid boundary
        raise invalid(f"malformed multipart body: {exc}") from exc
    settings = request.app[SETTINGS]
    idle = _Idle(settings.read_timeout_s)
    filename: str | None = None
    purpose: str | None = None
    staged: Path | None = None
    try:
        async with asyncio.timeout(settings.upload_timeout_s):
            for _ in range(MAX_PARTS):
                async with asyncio.timeout(idle.seconds):
                    part = await reader.next()
                if part is None:
                    break
                if not isinstance(part, BodyPartReader):  # a nested multipart: not part of the API
                    raise invalid("nested multipart bodies are not supported")
                if part.name == "file" and staged is None:
                    filename = part.filename or "upload.jsonl"
                    staged = await _stage_part(part, settings.max_file_bytes, staging, idle)
                elif part.name == "purpose" and purpose is None:
                    purpose = (await _read_field(part, MAX_FIELD_BYTES, "purpose", idle)).decode("utf-8", "replace")
                else:
                    while await idle.read(part, UPLOAD_CHUNK):  # drained, within the same time limits
                        pass
            else:
                raise invalid(f"a file upload has at most {MAX_PARTS} parts")
    except BaseException as exc:
        if staged is not None:
            staged.unlink(missing_ok=True)
        if isinstance(exc, TimeoutError):
            raise ApiError(408, "the upload was not received in time", code="request_timeout") from exc
        if isinstance(exc, ValueError) and not isinstance(exc, ApiError):  # the multipart parser's own errors
            raise invalid(f"malformed multipart body: {exc}") from exc
        raise
    if staged is None or filename is None:
        raise invalid("the 'file' field is required", "file")
    if purpose is None:
        staged.unlink(missing_ok=True)
        raise invalid("the 'purpose' field is required", "purpose")
    return filename, purpose.strip(), staged


@tenant
async def upload_file(request: web.Request) -> web.Response:
    """Upload a file (multipart: file, purpose=batch); batch input files are validated line by line."""
    tenant_id = request[CALLER].tenant_id
    store = file_store(request.app)
    staging = await asyncio.to_thread(store.staging_folder)
    filename, purpose, staged = await _read_upload(request, staging)
    try:
        return web.json_response(await _store_upload(request, store, tenant_id, filename, purpose, staged))
    finally:
        staged.unlink(missing_ok=True)  # gone already once adopted


async def _store_upload(request: web.Request, store: FileStore, tenant_id: int, filename: str, purpose: str,
                        staged: Path) -> dict[str, Any]:
    """Check the staged upload, then adopt it into the store with its row in one transaction."""
    if purpose not in files.USER_PURPOSES:
        raise invalid(f"purpose must be one of {', '.join(files.USER_PURPOSES)}, got {purpose!r}", "purpose")
    settings = request.app[SETTINGS]
    try:
        # Reads up to max_file_bytes from disk, line by line: off the event loop.
        await asyncio.to_thread(check_batch_input_file, staged, max_lines=settings.max_batch_lines,
                                max_bytes=settings.max_file_bytes,
                                max_line_bytes=int(settings.max_body_mb * 2**20))
    except BatchInputError as exc:
        raise invalid(str(exc), "file", code="invalid_batch_input") from exc
    created: list[str] = []

    def work(session: Session) -> dict[str, Any]:
        row = files.create_file(session, store, tenant_id, filename, purpose, staged)
        created.append(row.storage_key)
        return files.file_to_dict(row)

    try:
        return await in_transaction(request, work, not_found_param="file_id")
    except BaseException:
        # The row was not committed: its bytes must not linger in the store.
        for key in created:
            await asyncio.to_thread(store.delete, key)
        raise


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
