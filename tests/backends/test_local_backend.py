"""The backend conformance suite against a local directory."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ckptd.testing.conformance import BackendConformance
from ckptd.writer.backends import Capabilities, open_backend
from ckptd.writer.backends.local import LocalBackend


class TestLocalBackend(BackendConformance):
    expected = Capabilities(atomic_create=True, needs_fsync=True, multipart_cleanup=False)
    expects_local_root = True

    @pytest.fixture
    def backend_url(self, tmp_path: Path) -> str:
        return str(tmp_path / "root")

    @pytest.fixture
    def backend_options(self) -> Mapping[str, Any]:
        return {}

    @pytest.fixture
    def missing_url(self, tmp_path: Path) -> str:
        return f"file://{tmp_path}/no/such/root"


async def test_file_urls_and_relative_paths_are_one_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    async with await open_backend("file://" + str(tmp_path / "r")) as a, await open_backend("r") as b:
        assert isinstance(a, LocalBackend) and a.url == b.url == str(tmp_path / "r")
        await a.put("k", b"v")
        assert await b.get("k") == b"v"
        assert a.local_root == str(tmp_path / "r")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_no_space_and_quota_are_storage_full(tmp_path: Path, code: int) -> None:
    from ckptd.writer.errors import StorageError, StorageFullError

    backend = LocalBackend.open(str(tmp_path))
    direct = backend.error(OSError(code, os.strerror(code)))
    try:  # wrapped the way zarr/fsspec re-raise
        try:
            raise OSError(code, os.strerror(code))
        except OSError as inner:
            raise RuntimeError("store write failed") from inner
    except RuntimeError as outer:
        wrapped = backend.error(outer)
    for err in (direct, wrapped):
        assert isinstance(err, StorageFullError) and isinstance(err, StorageError) and isinstance(err, OSError)
    assert type(backend.error(OSError(errno.EIO, "io"))) is StorageError


async def test_a_create_whose_folder_sync_fails_takes_its_name_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create-once write (a commit marker) linked into place whose folder then fails to sync may not survive
    a crash: it is withdrawn, so the error its caller reports is what readers find, not a step committed."""
    from ckptd.writer.backends import local
    from ckptd.writer.errors import StorageError

    real = local._fsync_path

    def sync(path: str) -> None:
        if os.path.isdir(path) and os.path.basename(path) == "_ckptd":
            raise OSError(errno.EIO, "Input/output error")
        real(path)

    async with await open_backend(str(tmp_path / "r"), create=True) as backend:
        monkeypatch.setattr(local, "_fsync_path", sync)
        with pytest.raises(StorageError, match="Input/output error"):
            await backend.create("step_1/_ckptd/COMMITTED", b"{}")
        assert not await backend.exists("step_1/_ckptd/COMMITTED")
        assert os.listdir(tmp_path / "r" / "step_1" / "_ckptd") == []  # nor its file written aside
        monkeypatch.setattr(local, "_fsync_path", real)
        assert await backend.create("step_1/_ckptd/COMMITTED", b"{}")
        assert await backend.get("step_1/_ckptd/COMMITTED") == b"{}"
