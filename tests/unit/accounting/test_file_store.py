"""The local store adopts a staged file whole (a rename; a copy and rename from another file system)
and clears staged files a crash left behind."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from accounting import file_store
from accounting.file_store import LocalFileStore


def test_adopting_a_staged_file_moves_it_into_the_store(tmp_path: Path) -> None:
    store = LocalFileStore(tmp_path / "files")
    staged = store.staging_folder() / "upload-1.part"
    staged.write_bytes(b"lines\n")
    store.adopt("1/file-a", staged)
    assert store.get("1/file-a") == b"lines\n" and not staged.exists()


def test_adopting_from_another_file_system_copies_then_renames(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalFileStore(tmp_path / "files")
    elsewhere = tmp_path / "other-disk" / "upload.part"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"x" * 3_000_000)
    real_replace = os.replace

    def replace(source, target) -> None:  # a rename across file systems fails as on Linux
        if Path(source) == elsewhere:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_replace(source, target)

    monkeypatch.setattr(file_store.os, "replace", replace)
    store.adopt("1/file-b", elsewhere)
    assert store.get("1/file-b") == b"x" * 3_000_000 and not elsewhere.exists()
    assert [p.name for p in (tmp_path / "files" / "1").iterdir()] == ["file-b"]  # no temporary left


def test_staged_files_older_than_a_day_are_removed(tmp_path: Path) -> None:
    store = LocalFileStore(tmp_path / "files")
    folder = store.staging_folder()
    old, fresh = folder / "upload-old.part", folder / "upload-new.part"
    old.write_bytes(b"cut off by a crash")
    fresh.write_bytes(b"arriving now")
    two_days_ago = time.time() - 2 * 86400
    os.utime(old, (two_days_ago, two_days_ago))
    assert store.staging_folder() == folder
    assert sorted(p.name for p in folder.iterdir()) == ["upload-new.part"]
