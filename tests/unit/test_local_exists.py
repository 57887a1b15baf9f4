"""On a local root, a failure to look at a file is an error, never "not there": a commit marker that could
not be stat'ed (``EIO``, a stale NFS handle) read as absent made a committed step an unfinished one, which
retention deleted whatever ``--keep`` said."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from ckptd.writer import format as fmt
from ckptd.writer.backends.local import LocalBackend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import StorageError, StoragePermissionError


def _committed_root(path: Path, steps: tuple[int, ...]) -> LocalBackend:
    backend = LocalBackend.open(str(path))
    for step in steps:
        marker = path / fmt.commit_marker(step)
        marker.parent.mkdir(parents=True)
        marker.write_bytes(b"{}")
    return backend


def _failing_stat(monkeypatch: pytest.MonkeyPatch, suffix: str, err: int) -> None:
    real = os.stat

    def stat(p: object, *a: object, **k: object) -> os.stat_result:
        if str(p).endswith(suffix):
            raise OSError(err, os.strerror(err), str(p))
        return real(p, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)


def test_a_marker_that_cannot_be_read_is_an_error_and_retention_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _committed_root(tmp_path / "root", (1, 2, 3))
    writer = CheckpointWriter(backend)
    marker = fmt.commit_marker(1)
    assert asyncio.run(backend.exists(marker))
    assert not asyncio.run(backend.exists(fmt.commit_marker(4)))
    assert not asyncio.run(backend.exists(f"{marker}/below-a-file"))  # a parent that is a file: absent
    _failing_stat(monkeypatch, marker, errno.EIO)
    with pytest.raises(StorageError, match="Input/output error"):
        asyncio.run(backend.exists(marker))
    with pytest.raises(StorageError):
        asyncio.run(backend.exists_all([fmt.commit_marker(2), marker]))
    with pytest.raises(StorageError):
        asyncio.run(writer.retain(5))
    _failing_stat(monkeypatch, marker, errno.EACCES)
    with pytest.raises(StoragePermissionError):
        asyncio.run(writer.leftovers(1, 0))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "root")) == ["step_1", "step_2", "step_3"]
    assert asyncio.run(writer.committed_steps()) == [1, 2, 3]
