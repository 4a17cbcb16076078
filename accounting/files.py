"""Files of a tenant (OpenAI's Files API): metadata in SQL, bytes in a `FileStore`.

Like `accounting.tenants`, every function works on a caller-owned `Session`: it flushes but never
commits. Every lookup is scoped to a tenant: another tenant's file, or a deleted one, is
`FileNotFound`, exactly like an id that never existed (no existence oracle across tenants).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from accounting.file_store import FileStore
from accounting.models import File, utcnow
from accounting.tenants import AccountingError, NotFoundError

PURPOSES = ("batch", "batch_output", "batch_errors")
"""Every purpose a file can have; only `USER_PURPOSES` can be uploaded by callers."""
USER_PURPOSES = ("batch",)
"""Purposes a tenant may upload; `batch_output` / `batch_errors` files are written by batch jobs."""
FILENAME_MAX_LENGTH = 255
MAX_LIST_LIMIT = 10_000
ORDERS = ("asc", "desc")


class FileNotFound(NotFoundError):
    """No live file with that id belongs to the tenant."""

    code = "file_not_found"


class InvalidFileError(AccountingError):
    """A file's metadata (purpose, filename) or a listing parameter is invalid."""


def new_file_id() -> str:
    """`file-` and 24 random hex digits."""
    return f"file-{secrets.token_hex(12)}"


def _check_filename(filename: object) -> str:
    if not isinstance(filename, str) or not filename.strip():
        raise InvalidFileError("the file needs a filename")
    if len(filename) > FILENAME_MAX_LENGTH:
        raise InvalidFileError(f"the filename is longer than {FILENAME_MAX_LENGTH} characters")
    if any(ord(c) < 32 for c in filename):
        raise InvalidFileError("the filename contains control characters")
    return filename


def create_file(session: Session, store: FileStore, tenant_id: int, filename: str, purpose: str,
                data: bytes | Path) -> File:
    """Store `data` (bytes, or a file in `store.staging_folder()` that the store adopts), then add
    its row; returns the flushed `File`.

    The bytes are written first so a committed row always has its bytes. If the caller's
    transaction then fails, the bytes are orphaned: callers should `store.delete(f.storage_key)`.
    """
    if purpose not in PURPOSES:
        raise InvalidFileError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}")
    _check_filename(filename)
    file_id = new_file_id()
    # The key comes from the tenant id and a random id only, never from the filename.
    key = f"{tenant_id}/{file_id}"
    if isinstance(data, Path):
        size = data.stat().st_size
        store.adopt(key, data)
    else:
        size = len(data)
        store.put(key, data)
    row = File(id=file_id, tenant_id=tenant_id, filename=filename, purpose=purpose, bytes=size,
               storage_key=key, created_at=utcnow())
    session.add(row)
    try:
        session.flush()
    except Exception:
        store.delete(key)
        raise
    return row


def get_file(session: Session, tenant_id: int, file_id: str) -> File:
    """The tenant's live file `file_id`, else `FileNotFound`."""
    row = session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant_id,
                                            File.deleted_at.is_(None)))
    if row is None:
        raise FileNotFound(f"no such file: {file_id!r}")
    return row


def read_file_content(session: Session, store: FileStore, tenant_id: int, file_id: str) -> bytes:
    """The bytes of the tenant's live file `file_id` (`FileNotFound` as `get_file`)."""
    return store.get(get_file(session, tenant_id, file_id).storage_key)


def list_files(session: Session, tenant_id: int, purpose: str | None = None, limit: int = MAX_LIST_LIMIT,
               after: str | None = None, order: str = "desc") -> tuple[list[File], bool]:
    """(up to `limit` live files of the tenant, whether more follow), by creation time.

    `after` is a cursor: the id of the last file of the previous page (it must be the tenant's).
    """
    if purpose is not None and purpose not in PURPOSES:
        raise InvalidFileError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidFileError(f"limit must be between 1 and {MAX_LIST_LIMIT}")
    if order not in ORDERS:
        raise InvalidFileError("order must be asc or desc")
    query = select(File).where(File.tenant_id == tenant_id, File.deleted_at.is_(None))
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    if after is not None:
        try:
            cursor = get_file(session, tenant_id, after)
        except FileNotFound as exc:
            raise InvalidFileError(f"unknown 'after' cursor {after!r}") from exc
        # (created_at, id) is a total order: ties on created_at are broken by id.
        if order == "desc":
            query = query.where(or_(File.created_at < cursor.created_at,
                                    and_(File.created_at == cursor.created_at, File.id < cursor.id)))
        else:
            query = query.where(or_(File.created_at > cursor.created_at,
                                    and_(File.created_at == cursor.created_at, File.id > cursor.id)))
    if order == "desc":
        query = query.order_by(File.created_at.desc(), File.id.desc())
    else:
        query = query.order_by(File.created_at.asc(), File.id.asc())
    rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def delete_file(session: Session, tenant_id: int, file_id: str) -> File:
    """Soft-delete the tenant's file (`deleted_at` is set); returns the row.

    The caller removes the bytes (`store.delete(row.storage_key)`) only after its transaction has
    committed, so a failed commit never leaves a live row without bytes (at worst, bytes outlive
    a deleted row).
    """
    row = get_file(session, tenant_id, file_id)
    row.deleted_at = utcnow()
    session.flush()
    return row


def file_to_dict(f: File) -> dict[str, Any]:
    """The OpenAI File object."""
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": int(f.created_at.timestamp()),
            "filename": f.filename, "purpose": f.purpose, "status": "processed", "status_details": None}
