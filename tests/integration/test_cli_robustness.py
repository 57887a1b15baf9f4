"""The offline commands and ``serve`` on damaged roots and bad setups: ``verify`` and ``ls`` report a step that
cannot be read (or whose ``COMMITTED`` does not decode) and go on with the others, ``verify`` tells "corrupt"
(exit 1) from "could not read" (exit 3); ``gc --keep 0`` keeps every committed step, as ``serve --keep 0``
does, and a negative ``--keep`` is a usage error; ``serve``'s startup failures are one typed line, exit 2.

Steps are written by the real writer (no daemon). Permission failures are simulated (the suite may run as
root, which file modes do not stop)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from zarr.storage import FsspecStore

from ckptd.daemon import server
from ckptd.daemon.cli import EXIT_ERROR, main
from ckptd.daemon.offline import EXIT_CORRUPT, EXIT_UNREADABLE
from ckptd.testing.fixtures import commit_one_node
from ckptd.writer import format as fmt
from ckptd.writer.arrays import ChunkSink
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import StorageError

pytestmark = pytest.mark.timeout(120)
N, GRID = 8, 4  # one float32 array "x" of two chunks per step


def write_steps(root: str, *steps: int) -> None:
    """Committed steps with one array ``x`` of two chunks each (``step_N/x/c.0``, ``c.1``)."""

    async def one(step: int) -> None:
        async with await open_backend(root, None, create=True) as backend:
            ckpt, sink = CheckpointWriter(backend), ChunkSink(backend)
            data = np.arange(N, dtype=np.float32) + step
            chunks = []
            for coords in fmt.region_chunks([0], [N], [GRID]):
                block = data[fmt.chunk_selection_of(coords, [GRID], [N], [0])]
                crc, pieces = await sink.put(f"step_{step}/x/{fmt.chunk_key(coords, fmt.CHUNK_SEPARATOR)}", block)
                chunks.append(fmt.ChunkRecord(list(coords), block.nbytes, crc, pieces))
            rec = fmt.ArrayRecord("x", "float32", [N], [GRID], [fmt.ShardRecord(0, [0], [N], chunks)],
                                  separator=fmt.CHUNK_SEPARATOR)
            await commit_one_node(ckpt, step, [rec])

    for step in steps:
        asyncio.run(one(step))


def fail_reads(monkeypatch: pytest.MonkeyPatch, failing: dict[str, BaseException]) -> None:
    """Reads of these keys (relative to the root) through the zarr store raise the given error."""
    real_get = FsspecStore.get

    async def get(self: FsspecStore, key: str, *args: Any, **kwargs: Any) -> Any:
        if key in failing:
            raise failing[key]
        return await real_get(self, key, *args, **kwargs)

    monkeypatch.setattr(FsspecStore, "get", get)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def denied(key: str) -> PermissionError:
    return PermissionError(13, "Permission denied", key)


# --- verify -------------------------------------------------------------------------------------------
def test_verify_reports_an_unreadable_chunk_and_checks_the_other_steps(tmp_path: Path, monkeypatch, capsys) -> None:
    root = str(tmp_path / "ckpt")
    write_steps(root, 1, 2, 3)
    fail_reads(monkeypatch, {"step_2/x/c.0": denied("step_2/x/c.0")})
    rc, out, err = run(capsys, "verify", root, "--json")
    assert rc == EXIT_UNREADABLE == 3, err
    rows = {r["step"]: r for r in json.loads(out)}
    assert [rows[s]["state"] for s in (1, 2, 3)] == ["ok", "unreadable", "ok"]
    assert rows[3]["bytes"] == N * 4 and not rows[2]["ok"]
    (error,) = rows[2]["errors"]
    assert error.startswith("StoragePermissionError:") and "step_2/x/c.0" in error and "x not checked" in error
    assert "Traceback" not in err

    rc, out, _ = run(capsys, "verify", root)  # the text report goes on past the step too
    lines = out.splitlines()
    assert rc == 3 and lines[0].startswith("step 1: OK") and lines[-1].startswith("step 3: OK"), out
    assert lines[1].startswith("step 2: UNREADABLE (1 could not be read)"), out


def test_verify_types_a_storage_library_error_as_a_storage_error(tmp_path: Path, monkeypatch, capsys) -> None:
    """An error that is not an ``OSError`` (as botocore's are) is typed by the root's backend."""

    class ReadTimeoutError(Exception):
        pass

    root = str(tmp_path / "ckpt")
    write_steps(root, 1, 2)
    fail_reads(monkeypatch, {"step_1/x/c.1": ReadTimeoutError("read timeout on endpoint")})
    rc, out, _ = run(capsys, "verify", root, "--json")
    rows = json.loads(out)
    assert rc == 3 and [r["state"] for r in rows] == ["unreadable", "ok"]
    assert rows[0]["errors"][0].startswith("StorageError:") and "ReadTimeoutError" in rows[0]["errors"][0]


def test_verify_corrupt_wins_over_unreadable(tmp_path: Path, monkeypatch, capsys) -> None:
    root = str(tmp_path / "ckpt")
    write_steps(root, 1, 2, 3)
    chunk = Path(root, "step_3", "x", "c.1")
    chunk.write_bytes(b"\x01" + chunk.read_bytes()[1:])  # a flipped byte: fails its crc32c
    fail_reads(monkeypatch, {"step_1/x/c.0": denied("step_1/x/c.0")})
    rc, out, _ = run(capsys, "verify", root, "--json")
    assert rc == EXIT_CORRUPT == 1
    assert [r["state"] for r in json.loads(out)] == ["unreadable", "ok", "corrupt"]


def test_verify_lists_every_bad_chunk_of_an_array_and_checks_the_rest(tmp_path: Path, capsys) -> None:
    """A damaged array is reported chunk by chunk, not at its first bad chunk only: the extent of the damage."""
    root = str(tmp_path / "ckpt")
    write_steps(root, 1)
    for name in ("c.0", "c.1"):
        chunk = Path(root, "step_1", "x", name)
        chunk.write_bytes(b"\x01" + chunk.read_bytes()[1:])
    rc, out, _ = run(capsys, "verify", root, "--json")
    (row,) = json.loads(out)
    assert rc == EXIT_CORRUPT and row["state"] == "corrupt" and row["bytes"] == 0, row
    assert [e.split(": ")[0] for e in row["errors"]] == ["CorruptCheckpointError"] * 2, row
    assert "chunk [0]" in row["errors"][0] and "chunk [1]" in row["errors"][1], row
    Path(root, "step_1", "x", "c.1").unlink()  # one bad, one missing: both told, in the text report too
    rc, out, _ = run(capsys, "verify", root)
    assert rc == EXIT_CORRUPT and out.startswith("step 1: CORRUPT (2 failed check(s))"), out
    assert "chunk [1] missing" in out, out


def test_a_garbage_commit_marker_is_one_corrupt_step(tmp_path: Path, capsys) -> None:
    root = str(tmp_path / "ckpt")
    write_steps(root, 1, 2, 3)
    Path(root, fmt.commit_marker(2)).write_bytes(b"garbage\n")

    rc, out, err = run(capsys, "verify", root, "--json")
    assert rc == EXIT_CORRUPT, err
    rows = json.loads(out)
    assert [(r["step"], r["state"]) for r in rows] == [(1, "ok"), (2, "corrupt"), (3, "ok")]
    assert "CorruptCheckpointError" in rows[1]["errors"][0] and "COMMITTED" in rows[1]["errors"][0]

    rc, out, err = run(capsys, "ls", root, "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [(r["step"], r["state"]) for r in rows] == [(1, "committed"), (2, "corrupt"), (3, "committed")]
    assert rows[1]["error"].startswith("CorruptCheckpointError:") and rows[2]["arrays"] == 1

    rc, out, _ = run(capsys, "ls", root)
    row2 = [ln for ln in out.splitlines() if ln.split()[0] == "2"]
    assert rc == 0 and len(out.splitlines()) == 4 and "corrupt" in row2[0] and "CorruptCheckpointError" in row2[0]


def test_ls_shows_a_step_it_cannot_read_and_goes_on(tmp_path: Path, monkeypatch, capsys) -> None:
    root = str(tmp_path / "ckpt")
    write_steps(root, 1, 2)
    fail_reads(monkeypatch, {fmt.commit_marker(1): denied(fmt.commit_marker(1))})
    rc, out, _ = run(capsys, "ls", root, "--json")
    rows = json.loads(out)
    assert rc == 0 and [(r["step"], r["state"]) for r in rows] == [(1, "unreadable"), (2, "committed")]
    assert rows[0]["error"].startswith("StoragePermissionError:")
    rc, out, _ = run(capsys, "verify", root, "--json")
    assert rc == 3 and [r["state"] for r in json.loads(out)] == ["unreadable", "ok"]


def test_verify_of_a_step_that_is_not_there_is_still_a_usage_error(tmp_path: Path, capsys) -> None:
    root = str(tmp_path / "ckpt")
    write_steps(root, 1)
    rc, _, err = run(capsys, "verify", root, "--step", "7")
    assert rc == EXIT_ERROR and "CheckpointNotFoundError" in err


# --- gc -----------------------------------------------------------------------------------------------
def _steps(root: str) -> list[str]:
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith("step_"))


def test_gc_keep_zero_keeps_every_committed_step(tmp_path: Path, capsys) -> None:
    root = str(tmp_path / "ckpt")
    write_steps(root, 1, 2, 4)
    Path(root, "step_3", "x").mkdir(parents=True)  # an unfinished step older than the newest commit
    Path(root, "step_3", "x", "c.0").write_bytes(b"\0" * 20)
    rc, out, _ = run(capsys, "gc", root, "--keep", "0", "--dry-run", "--grace", "0")
    assert rc == 0 and "would remove steps: [3]" in out, out
    rc, out, _ = run(capsys, "gc", root, "--keep", "0", "--grace", "0")
    assert rc == 0 and "removed steps: [3]" in out and _steps(root) == ["step_1", "step_2", "step_4"], out
    rc, out, _ = run(capsys, "gc", root, "--keep", "2")
    assert rc == 0 and "removed steps: [1]" in out and _steps(root) == ["step_2", "step_4"], out


@pytest.mark.parametrize("keep", ["-5", "-1", "two"])
def test_gc_refuses_a_negative_keep(tmp_path: Path, keep: str, capsys) -> None:
    root = str(tmp_path / "ckpt")
    write_steps(root, 1, 2)
    with pytest.raises(SystemExit) as info:
        main(["gc", root, "--keep", keep])
    assert info.value.code == 2 and "--keep" in capsys.readouterr().err
    assert _steps(root) == ["step_1", "step_2"]


# --- serve: startup failures --------------------------------------------------------------------------
def _serve(tmp_path: Path, sockdir: str, capsys: pytest.CaptureFixture[str], *flags: str,
           root: str | None = None) -> tuple[int, str]:
    rc = main(["serve", "--root", root or str(tmp_path / "ckpt"), "--socket", os.path.join(sockdir, "s", "d.sock"),
               "--arena-size", "4MiB", "--no-prefault", *flags])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, err.strip().splitlines()[-1]


def test_serve_with_a_negative_nice_it_may_not_take(tmp_path: Path, sockdir: str, monkeypatch, capsys) -> None:
    def nice(increment: int) -> int:
        if increment < 0:
            raise PermissionError(1, "Operation not permitted")
        return 0

    monkeypatch.setattr(os, "nice", nice)
    rc, line = _serve(tmp_path, sockdir, capsys, "--nice", "-5")
    assert rc == 2 and line.startswith("ckptd serve: ConfigError: --nice -5") and "CAP_SYS_NICE" in line, line


def test_serve_with_a_socket_directory_of_another_user(tmp_path: Path, sockdir: str, monkeypatch, capsys) -> None:
    os.makedirs(os.path.join(sockdir, "s"), mode=0o700)
    other = os.stat(sockdir).st_uid + 4242
    monkeypatch.setattr(os, "getuid", lambda: other)
    rc, line = _serve(tmp_path, sockdir, capsys, "--nice", "0")
    assert rc == 2 and line.startswith("ckptd serve: ConfigError: socket directory") and "belongs to uid" in line


def test_serve_with_a_root_it_cannot_create(tmp_path: Path, sockdir: str, monkeypatch, capsys) -> None:
    root = str(tmp_path / "locked" / "ckpt")
    real = os.makedirs

    def makedirs(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path) == root:
            raise PermissionError(13, "Permission denied", root)
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    rc, line = _serve(tmp_path, sockdir, capsys, "--nice", "0", root=root)
    assert rc == 2 and line.startswith("ckptd serve: StoragePermissionError: cannot create checkpoint root"), line


def test_serve_reports_a_typed_error_of_its_startup_bare(tmp_path: Path, sockdir: str, monkeypatch, capsys) -> None:
    """A typed error raised inside the daemon's task group reaches the command as itself, not as a group."""

    async def broken(*_args: Any) -> None:
        raise StorageError("the journal's root is unreachable")

    monkeypatch.setattr(server, "abandon_predecessor_steps", broken)
    rc, line = _serve(tmp_path, sockdir, capsys, "--nice", "0")
    assert rc == 2 and line == "ckptd serve: StorageError: the journal's root is unreachable", line


def test_verify_reports_an_unreadable_failure_note_and_goes_on(tmp_path: Path, monkeypatch, capsys) -> None:
    """An uncommitted step's failure note that cannot be read (not a damaged one: a storage error) is a row
    saying so, exit 3; the committed steps are still checked."""
    root = str(tmp_path / "ckpt")
    write_steps(root, 1, 3)

    async def failed_step() -> None:
        async with await open_backend(root, None) as backend:
            await CheckpointWriter(backend).mark_failed(2, StorageError("disk gone"))

    asyncio.run(failed_step())
    key = fmt.failed_marker(2)
    fail_reads(monkeypatch, {key: denied(key)})
    rc, out, _ = run(capsys, "verify", root, "--json")
    rows = {r["step"]: r for r in json.loads(out)}
    assert rc == EXIT_UNREADABLE, (rc, rows)
    assert rows[2]["state"] == "unreadable" and "StoragePermissionError" in rows[2]["errors"][0], rows[2]
    assert rows[1]["ok"] and rows[3]["ok"]


def test_ls_of_a_steps_folder_names_its_root_and_an_empty_root_is_refused(tmp_path: Path, capsys) -> None:
    """A step's own folder given for the root (as Megatron users point at ``iter_N``) is an error that names the
    root and the step; an empty root (the current directory, wherever the command runs) is refused; a root
    with no steps yet lists an empty table and says so on stderr."""
    root = str(tmp_path / "ckpt")
    write_steps(root, 12)
    assert main(["ls", os.path.join(root, "step_12")]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "is the folder of step 12, not a checkpoint root" in err and f"ckptd ls {root} --step 12" in err, err
    for empty in ("", "file://"):
        assert main(["ls", empty]) == EXIT_ERROR
        assert "ConfigError: the checkpoint root is empty" in capsys.readouterr().err
    (tmp_path / "new").mkdir()
    assert main(["ls", str(tmp_path / "new")]) == 0
    assert f"no steps under {tmp_path / 'new'}" in capsys.readouterr().err
    (tmp_path / "iter_0000100" / "_ckptd").mkdir(parents=True)  # a new root that happens to be called so
    assert main(["ls", str(tmp_path / "iter_0000100")]) == 0
    assert "no steps under" in capsys.readouterr().err


def test_an_unknown_log_level_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--log-level", "bogus", "ls", "."])
    assert exc.value.code == 2 and "not a log level: 'bogus'" in capsys.readouterr().err
    monkeypatch.setenv("CKPTD_LOG_LEVEL", "verbose")
    with pytest.raises(SystemExit) as exc:
        main(["ls", "."])
    assert exc.value.code == 2 and "not a log level: 'verbose'" in capsys.readouterr().err
    monkeypatch.setenv("CKPTD_LOG_LEVEL", "warn")  # logging's own names pass, WARN and FATAL too
    assert main(["ls", str(tmp_path)]) == 0


def test_gc_after_rolls_the_root_back_to_a_committed_step(tmp_path: Path, capsys) -> None:
    """``gc --after 10``: every step after 10 goes, committed or not (newest first), and ``latest`` names 10;
    an unfinished step after it written to within ``--grace`` stays (a daemon may be writing it); a step that
    is not committed is refused as the rollback's target; ``--dry-run`` removes nothing."""
    root = tmp_path / "ckpt"
    write_steps(str(root), 5, 10, 20, 30)
    for step in (15, 25):  # unfinished: chunks without a commit
        (root / f"step_{step}" / "x").mkdir(parents=True)
        (root / f"step_{step}" / "x" / "c.0").write_bytes(b"\0" * 16)
    os.utime(root / "step_15" / "x" / "c.0", (0, 0))  # long ago; step 25 was written just now
    assert main(["gc", str(root), "--after", "10", "--dry-run", "--grace", "0"]) == 0
    assert "would remove steps after 10: [30, 25, 20, 15]" in capsys.readouterr().out
    assert main(["gc", str(root), "--after", "10", "--dry-run"]) == 0  # a preview: exit 0, what it would keep
    out = capsys.readouterr().out
    assert "would remove steps after 10: [30, 20, 15]" in out and "would keep unfinished steps after 10" in out, out
    assert main(["gc", str(root), "--after", "10", "--keep", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out  # retention's preview counts the rollback's steps gone: 10 is the newest
    assert "would remove steps: [5]" in out, out
    assert "kept unfinished steps written to within" not in out, out  # 25 is the rollback's, not retention's
    assert sorted(p.name for p in root.glob("step_*")) == ["step_10", "step_15", "step_20", "step_25", "step_30",
                                                           "step_5"]
    assert main(["gc", str(root), "--after", "10"]) == EXIT_CORRUPT  # not complete: a step after 10 was kept
    captured = capsys.readouterr()
    assert "removed steps after 10: [30, 20, 15]" in captured.out, captured.out
    assert "the rollback is not complete" in captured.err and "were kept: [25]" in captured.err, captured.err
    assert sorted(p.name for p in root.glob("step_*")) == ["step_10", "step_25", "step_5"]
    assert (root / fmt.latest_key()).read_text() == "10"
    assert main(["ls", str(root), "--step", "latest", "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [10]
    assert main(["gc", str(root), "--after", "7"]) == EXIT_ERROR  # not committed: not a rollback target
    assert "step 7 is not committed" in capsys.readouterr().err
    assert main(["gc", str(root)]) == EXIT_ERROR
    assert "gc needs --keep N, --after STEP, or both" in capsys.readouterr().err
    assert main(["gc", str(root), "--after", "10", "--keep", "1", "--grace", "0"]) == 0  # both: rollback, then keep
    assert sorted(p.name for p in root.glob("step_*")) == ["step_10"]
