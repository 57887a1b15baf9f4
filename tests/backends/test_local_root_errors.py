"""Opening a local checkpoint root that cannot be made or reached is a typed error naming it: a parent without
search permission is a permission error, not "does not exist". Simulated (root ignores file modes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ckptd.writer.backends.local import LocalBackend
from ckptd.writer.errors import StorageError, StorageNotFoundError, StoragePermissionError


def _deny(monkeypatch: pytest.MonkeyPatch, name: str, path: str) -> None:
    real = getattr(os, name)

    def fake(p: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(p) == path:
            raise PermissionError(13, "Permission denied", path)
        return real(p, *args, **kwargs)

    monkeypatch.setattr(os, name, fake)


def test_a_root_that_cannot_be_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path / "ckpt")
    _deny(monkeypatch, "makedirs", root)
    with pytest.raises(StoragePermissionError, match=f"cannot create checkpoint root {root}"):
        LocalBackend.open(root, create=True)


def test_a_root_under_an_unsearchable_parent_is_a_permission_error(tmp_path: Path, monkeypatch) -> None:
    root = str(tmp_path / "ckpt")
    os.mkdir(root)
    _deny(monkeypatch, "stat", root)  # what stat says under a parent without x permission: EACCES
    with pytest.raises(StoragePermissionError, match=f"cannot open checkpoint root {root}"):
        LocalBackend.open(root, create=False)


def test_missing_and_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(StorageNotFoundError, match="does not exist"):
        LocalBackend.open(str(tmp_path / "nothere"), create=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageNotFoundError, match="is not a directory"):
        LocalBackend.open(str(tmp_path / "file"), create=False)
    with pytest.raises(StorageError, match="cannot create checkpoint root"):
        LocalBackend.open(str(tmp_path / "file" / "ckpt"), create=True)  # a file where a parent should be
