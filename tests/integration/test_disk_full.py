"""Disk full, on a real size-limited filesystem (a tmpfs mounted for the test; needs root, as CI has).

A step that hits ENOSPC fails with :class:`StorageFullError` on every rank's ``wait()``, releases its arena
space, leaves the earlier committed step loadable and the daemon serving; the failure is delivered once
(the next ``save()`` does not raise it again); when space returns the next step commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.reader import load
from ckptd.testing.fixtures import unavailable
from ckptd.writer.backends import Backend, open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import StorageError, StorageFullError
from ckptd.writer.format import FORMAT_VERSION, PartManifest, encode_json, latest_key

pytestmark = pytest.mark.timeout(300)
MiB = 1 << 20
CLI = [sys.executable, "-m", "ckptd.daemon.cli"]


@contextlib.contextmanager
def _tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        unavailable(f"mounting a size-limited tmpfs needs root: {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with _tmpfs(tmp_path / "small", "40m") as mnt:
        yield mnt


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    with _tmpfs(tmp_path / "tiny", "1m") as mnt:
        yield mnt


def fill(path: Path, leave: int, name: str = "filler") -> Path:
    """Fill the filesystem of ``path`` until ``leave`` bytes are free; returns the filler file."""
    filler = path / name
    block = b"\0" * MiB
    with open(filler, "wb") as fh:
        while True:
            st = os.statvfs(path)
            free = st.f_bavail * st.f_frsize
            if free <= leave:
                break
            try:
                fh.write(block[: min(MiB, free - leave)])
                fh.flush()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    return filler


def _fill_until_settled(path: Path, settle_s: float = 0.3, timeout: float = 30.0) -> list[Path]:
    """Fill again until no free space shows up for ``settle_s`` (stray cleanups free blocks late)."""
    fillers: list[Path] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fillers.append(fill(path, leave=0, name=f"filler-{len(fillers) + 2}"))
        time.sleep(settle_s)
        st = os.statvfs(path)
        if st.f_bavail == 0:
            return fillers
    raise AssertionError(f"{path} did not stay full within {timeout}s")


def _state(rank: int, step: int, numel: int) -> dict[str, Shard]:
    g = torch.Generator().manual_seed(100 * step + rank)
    w = torch.randn(numel, generator=g)
    return {"w": Shard("w", w, (2 * numel,), (rank * numel,))}


def _check(root: str, step: int, numel: int) -> None:
    for rank in range(2):
        template = {"w": Shard("w", torch.zeros(numel), (2 * numel,), (rank * numel,))}
        load(root, step, template)
        assert torch.equal(template["w"].data, _state(rank, step, numel)["w"].data), (step, rank)


def test_enospc_fails_the_step_typed_once_and_the_next_step_commits(small_fs: Path, start_daemon) -> None:
    root = str(small_fs / "ckpt")
    d = start_daemon(root, "d0", "--part-timeout", "60", arena="32MiB")
    clients = [CheckpointClient(d.socket, placement=Placement(r, 2, 2, 0), lease_timeout_s=20) for r in range(2)]
    small, big = (256 * 1024) // 4, (12 * MiB) // 4  # elements per rank: 256 KiB and 12 MiB
    for h in [c.save(1, _state(r, 1, small)) for r, c in enumerate(clients)]:
        h.wait(60)
    _check(root, 1, small)

    filler = fill(small_fs, leave=2 * MiB)
    handles = [c.save(2, _state(r, 2, big)) for r, c in enumerate(clients)]  # 24 MiB staged of the 32 MiB arena
    for h in handles:
        with pytest.raises(StorageFullError) as info:
            h.wait(120)
        assert isinstance(info.value, StorageError) and isinstance(info.value, OSError)
    _check(root, 1, small)  # the earlier step is intact

    filler.unlink()
    # delivered once: this save must not re-raise step 2's failure; it needs step 2's arena space back
    handles = [c.save(3, _state(r, 3, big)) for r, c in enumerate(clients)]
    for h in handles:
        h.wait(120)
    _check(root, 3, big)
    _check(root, 1, small)
    listing = json.loads(subprocess.run([*CLI, "ls", root, "--json"], capture_output=True, text=True,
                                        check=True).stdout)
    state = {row["step"]: row for row in listing}
    assert state[1]["committed"] and state[3]["committed"] and not state.get(2, {"committed": False})["committed"]
    for c in clients:
        c.close()


# --- the disk fills while the part manifest or the marker is written (writer level) ------------------
def _part(step: int) -> PartManifest:
    return PartManifest(format=FORMAT_VERSION, step=step, node=0, num_nodes=1, world_size=1, ranks=[0], arrays=[],
                        objects={"0": {"step": step, "pad": "x" * 4096}}, nbytes=0, written_at=time.time())


def _tmp_leftovers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*.tmp")]


async def _with_step_1(backend: Backend) -> CheckpointWriter:
    """A writer on ``backend`` whose root holds committed step 1 (written while there is space)."""
    w = CheckpointWriter(backend)
    await w.write_part(_part(1))
    await w.commit(1, 1, timeout=5)
    return w


def test_disk_full_during_part_manifest_and_marker_writes(tiny_fs: Path) -> None:
    root = tiny_fs / "ckpt"

    async def run() -> None:
        async with await open_backend(str(root)) as backend:
            w = await _with_step_1(backend)

            filler = fill(tiny_fs, leave=0)
            with pytest.raises(StorageFullError):  # the part manifest
                await w.write_part(_part(2))
            filler.unlink()

            await w.write_part(_part(2))
            filler = fill(tiny_fs, leave=0)
            with pytest.raises(StorageFullError):  # the commit: metadata documents, then the marker
                await w.commit(2, 1, timeout=5)
            # the failed commit cleans up after itself, partly in worker threads that outlive its error: take
            # the blocks they free too, until the filesystem stays full
            topups = _fill_until_settled(tiny_fs)
            with pytest.raises(StorageFullError):  # the marker itself (create-once: temp file, link)
                await w.write_marker(2, encode_json(_part(2)))
            assert not await w.is_committed(2)
            assert await w.committed_steps() == [1] and await w.latest() == 1
            assert _tmp_leftovers(root) == []  # a failed create-once leaves no temp file behind
            assert (await w.read_commit(1)).objects["0"]["step"] == 1

            filler.unlink()  # space is back: the same step commits
            for topup in topups:
                topup.unlink()
            await w.commit(2, 1, timeout=5)
            assert await w.committed_steps() == [1, 2] and await w.latest() == 2

    asyncio.run(run())


def test_disk_full_mid_write_leaves_the_earlier_part_and_latest_whole(tiny_fs: Path) -> None:
    """A part manifest or ``latest`` that the disk cannot hold fails with :class:`StorageFullError` and
    leaves the earlier one as it was: a torn part would stop every later commit of the step (it does not
    decode), a torn ``latest`` would read as no step."""
    root = tiny_fs / "ckpt"

    async def run() -> None:
        async with await open_backend(str(root)) as backend:
            w = await _with_step_1(backend)
            earlier = _part(2)  # an earlier attempt's part of step 2
            await w.write_part(earlier)

            filler = fill(tiny_fs, leave=8 * 1024)  # room for part of the new part, not all of it
            bigger = msgspec.structs.replace(earlier, objects={"0": {"step": 2, "pad": "y" * (64 * 1024)}})
            with pytest.raises(StorageFullError):
                await w.write_part(bigger)
            assert await w.read_parts(2) == {0: earlier}
            topups = _fill_until_settled(tiny_fs)
            with pytest.raises(StorageFullError):
                await backend.replace(latest_key(), b"2")
            assert await w.latest_hint() == 1
            assert _tmp_leftovers(root) == []

            filler.unlink()
            for topup in topups:
                topup.unlink()
            await w.write_part(bigger)
            assert await w.read_parts(2) == {0: bigger}
            await w.commit(2, 1, timeout=5)
            assert await w.latest_hint() == 2 and await w.latest() == 2

    asyncio.run(run())
