"""On a local root, a failure to look at a file is an error, never "not there": a commit marker that could
not be stat'ed (``EIO``, a stale NFS handle) read as absent made a committed step an unfinished one, which
retention deleted whatever ``--keep`` said. Such a step is now left alone, and hides no other step (ls, verify,
retention, ``latest``); a waiter for the commit polls through a failure that passes."""

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


def test_a_marker_that_cannot_be_read_is_an_error_and_retention_leaves_it_alone(
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
    assert asyncio.run(writer.retain(1)) == [2]  # the unreadable step 1 is left alone, not counted
    _failing_stat(monkeypatch, marker, errno.EACCES)
    with pytest.raises(StoragePermissionError):
        asyncio.run(writer.leftovers(1, 0))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "root")) == ["step_1", "step_3"]
    assert asyncio.run(writer.committed_steps()) == [1, 3]


def test_a_passing_failure_while_waiting_for_the_commit_is_polled_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stat that fails once (a stale NFS handle) while a node waits for the coordinator's marker used to
    end the wait at once with a StorageError, and the node reported failed a step that then committed."""
    from ckptd.testing.fixtures import commit_one_node

    backend = LocalBackend.open(str(tmp_path / "root"))
    writer = CheckpointWriter(backend)
    asyncio.run(commit_one_node(writer, 1, []))
    real, failed = os.stat, []

    def stat_once(p: object, *a: object, **k: object) -> os.stat_result:
        if str(p).endswith(fmt.commit_marker(1)) and not failed:
            failed.append(p)
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(p))
        return real(p, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat_once)
    assert asyncio.run(writer.wait_committed(1, timeout=30.0, node=1)).step == 1
    assert failed  # the first look failed; the next one found the marker


def test_one_unreadable_step_hides_no_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``ckptd ls`` lists it as unreadable and goes on, ``ckptd verify`` checks the others and exits 3,
    retention deletes around it, and ``latest`` is the newest committed step unless it is newer."""
    from ckptd.daemon.cli import main
    from ckptd.testing.fixtures import commit_one_node

    root = tmp_path / "root"
    backend = LocalBackend.open(str(root))
    writer = CheckpointWriter(backend)

    async def commit_all() -> None:
        for step in (1, 2, 3, 4):
            await commit_one_node(writer, step, [])

    asyncio.run(commit_all())
    _failing_stat(monkeypatch, fmt.commit_marker(2), errno.EACCES)
    assert main(["ls", str(root)]) == 0
    listing = capsys.readouterr().out
    assert "unreadable" in listing and " 4  committed" in listing
    assert main(["verify", str(root)]) == 3
    out = capsys.readouterr().out
    assert "step 2: UNREADABLE (not checked)" in out and "step 4: OK" in out
    assert asyncio.run(writer.latest()) == 4
    assert asyncio.run(writer.retain(1)) == [1, 3]  # step 2 left alone, not counted
    _failing_stat(monkeypatch, fmt.commit_marker(4), errno.EIO)
    with pytest.raises(StorageError):
        asyncio.run(writer.latest())  # it may be the newest
    monkeypatch.undo()
    assert asyncio.run(writer.committed_steps()) == [2, 4]


def test_the_manifest_read_after_the_marker_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the marker is seen, the commit manifest is there: a read of it that fails once is tried again,
    not reported as a failed step."""
    from ckptd.testing.fixtures import commit_one_node
    from ckptd.writer import polls

    backend = LocalBackend.open(str(tmp_path / "root"))
    writer = CheckpointWriter(backend)
    asyncio.run(commit_one_node(writer, 1, []))
    real, failed = writer.read_commit, []

    async def read_once(step: int) -> object:
        if not failed:
            failed.append(step)
            raise StorageError("a stale file handle")
        return await real(step)

    monkeypatch.setattr(writer, "read_commit", read_once)
    no_wait = asyncio.sleep
    monkeypatch.setattr(polls.asyncio, "sleep", lambda s: no_wait(0))
    assert asyncio.run(writer.wait_committed(1, timeout=30.0, node=1)).step == 1 and failed == [1]


def test_verify_of_a_root_whose_steps_all_failed_says_so(tmp_path: Path, capsys) -> None:
    from ckptd.daemon.cli import main
    from ckptd.writer.errors import StepFailedError

    root = tmp_path / "root"
    writer = CheckpointWriter(LocalBackend.open(str(root)))
    asyncio.run(writer.mark_failed(5, StepFailedError("disk full")))
    assert main(["verify", str(root)]) == 1
    captured = capsys.readouterr()
    assert "step 5: FAILED" in captured.out and "no committed steps to verify" in captured.err
