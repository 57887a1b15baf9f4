"""Kill matrix: ``kill -9`` of the daemon at many precise points of a save, on S3 and on a local filesystem.

How the daemon is frozen at a point before the kill:

- S3: the fault proxy holds one request (a ``stall`` fault selected by method and path) and the test
  waits until that request is held;
- local filesystem: a chunk's file is created beforehand as a named pipe, so the daemon's write of that
  chunk blocks in ``open()`` while the step's other chunks land (only chunk writes are frozen this way: the
  metadata documents are written after every chunk is durable);
- both: ``rank-copy`` kills the daemon from inside the rank's copy into the staging arena (a ``Shard``
  whose ``stage_into`` copies half, kills, copies the rest), before the save's request was sent (the
  daemon may have started the step from the save's announcement, ``PrepareStep``).

Afterwards, for every point:

- no corrupt or half-visible step: every committed step verifies chunk by chunk against its crc32c;
  the killed step is committed exactly when the kill came after its marker (and then it verifies too);
- the previous step loads bit-exact;
- the training loop keeps going: the killed save's handle reports ``FAILED`` without raising
  (``on_daemon_lost="warn"``), or ``COMMITTED`` when the kill came after its marker (the handle finds the
  commit in storage), a restarted daemon takes the next step, and it commits;
- the restarted daemon abandons what its predecessor had in flight (daemon/journal.py): every such step
  that did not commit carries an ``abandoned`` failure note.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import torch
from test_s3 import aws_env, in_aws_env, options, s3_flags  # noqa: F401 (fixture)

from ckptd.client import CheckpointClient, Placement, SaveHandle, Shard, StepState
from ckptd.client.reader import load
from ckptd.daemon.journal import journal_path
from ckptd.testing.faultproxy import FaultProxy
from ckptd.testing.fixtures import BUCKET
from ckptd.testing.launch import DaemonProcess
from ckptd.testing.s3server import S3Server
from ckptd.writer.arrays import verify_array
from ckptd.writer.format import commit_marker, latest_key, part_key, parts_dir, sidecar_key, step_dir
from ckptd.writer.root import open_root

pytestmark = pytest.mark.timeout(180)

KILLED = 3  # steps 1 and 2 commit first (retention with --keep 2 then has a step to delete)


@dataclass(frozen=True)
class Point:
    path: str = ""  # S3: regex on the request target the proxy holds
    methods: tuple[str, ...] | None = None
    marker_landed: bool = False  # the kill comes after the COMMITTED write: the step must be committed
    rank_copy: bool = False  # killed from inside the rank's copy into the arena
    fifo: str = ""  # local: this chunk of the killed step is a named pipe (its write blocks)


RANK_COPY = Point(rank_copy=True)
S3_POINTS = {
    "rank-copy": RANK_COPY,
    # accept: the daemon checks the step is not committed yet; the rank is blocked in save()
    "accept-commit-check": Point(rf"/{re.escape(commit_marker(KILLED))}", ("HEAD", "GET")),
    "accept-sidecar": Point(rf"/{re.escape(sidecar_key(''))}[0-9a-f]+\.json", ("PUT",)),
    "first-chunk": Point(rf"/step_{KILLED}/model/w/c\.0(\?|$)", ("PUT",)),
    "later-chunk": Point(rf"/step_{KILLED}/model/w/c\.5(\?|$)", ("PUT",)),
    "packed-small-array": Point(rf"/step_{KILLED}/model/b(/|\?|$)", ("PUT",)),
    "part-manifest": Point(rf"/{re.escape(part_key(KILLED, 0))}", ("PUT",)),
    "parts-listing": Point(rf"prefix=[^&]*{quote(parts_dir(KILLED), safe='')}", ("GET",)),
    "array-zarr-json": Point(rf"/step_{KILLED}/model/w/zarr\.json", ("PUT",)),
    "group-zarr-json": Point(rf"/step_{KILLED}/model/zarr\.json", ("PUT",)),
    "root-zarr-json": Point(r"/kill-root-zarr-json/zarr\.json", ("PUT",)),
    "marker": Point(rf"/{re.escape(commit_marker(KILLED))}", ("PUT",)),
    "latest": Point(rf"/{re.escape(latest_key())}(\?|$)", ("PUT",), marker_landed=True),
    "retention-marker-delete": Point(rf"/{re.escape(commit_marker(1))}|\?delete", ("DELETE", "POST"),
                                     marker_landed=True),
}
LOCAL_POINTS = {
    "rank-copy": RANK_COPY,
    "later-chunk": Point(fifo="model/w/c.5"),
}
# The default (CI) run: one point of the staging side and one of the data writes on a local filesystem,
# a part and a commit point on S3 (about 20 s together); the rest run with -m slow.
DEFAULT_RUN = {("local", "rank-copy"), ("local", "later-chunk"), ("s3", "part-manifest"), ("s3", "marker")}


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model/w": torch.randn(8 * 16 * 1024, generator=g),  # 512 KiB: eight 64 KiB chunks
        "model/b": torch.randn(33, generator=g),  # small: packed into one object on S3
    }


@dataclass(frozen=True)
class _KillMidCopy(Shard):
    """A shard whose copy into the staging slot kills the daemon half-way (``kill`` is set by the test)."""

    kill: Callable[[], None] = lambda: None

    def stage_into(self, dst: torch.Tensor, non_blocking: bool = False) -> None:
        half = dst.numel() // 2
        dst[:half].copy_(self.data[:half])
        self.kill()
        dst[half:].copy_(self.data[half:])


def _killing_state(step: int, kill: Callable[[], None]) -> dict[str, Any]:
    state: dict[str, Any] = _state(step)
    w = state["model/w"]
    state["model/w"] = _KillMidCopy("model/w", w, tuple(w.shape), (0,), kill=kill)
    return state


def _loads(root: str, step: int, opts: dict[str, Any] | None) -> None:
    want = _state(step)
    template = {k: torch.zeros_like(v) for k, v in want.items()}
    load(root, step, template, storage_options=opts)
    for k, v in want.items():
        assert torch.equal(template[k], v), (step, k)


async def _verify_all(root: str, opts: dict[str, Any] | None) -> dict[int, int]:
    """Every committed step re-read and checked against its checksums: step -> bytes verified."""
    out = {}
    async with open_root(root, opts, create=False) as r:
        for step in await r.committed_steps():
            commit = await r.read_commit(step)
            out[step] = sum([await verify_array(r.store, step_dir(step), rec) for rec in commit.arrays])
    return out


async def _parts(root: str, opts: dict[str, Any] | None, step: int) -> dict[int, Any]:
    async with open_root(root, opts, create=False) as r:
        return await r.read_parts(step)


async def _failure_notes(root: str, opts: dict[str, Any] | None, steps: list[int]) -> dict[int, dict[str, Any]]:
    async with open_root(root, opts, create=False) as r:
        return {s: note for s in steps if (note := await r.read_failed(s)) is not None and not await r.is_committed(s)}


def _wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def _run_point(
    point: str, where: Point, root: str, opts: dict[str, Any] | None, start: Callable[[], DaemonProcess],
    arm: Callable[[], None], reached: Callable[[], bool], disarm: Callable[[], None],
) -> None:
    """Save two steps, kill the daemon at ``where`` during the third, restart it, check every guarantee."""
    d = start()
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
    for step in (1, 2):
        client.save(step, _state(step)).wait(60)

    arm()
    handles: list[SaveHandle] = []
    sidecar = json.dumps({"point": point})  # a new sidecar: written while the save is accepted
    state = _killing_state(KILLED, d.kill) if where.rank_copy else _state(KILLED)
    saver = threading.Thread(target=lambda: handles.append(client.save(KILLED, state, sidecars=[sidecar])))
    saver.start()
    if not where.rank_copy:
        assert _wait_until(reached, 30), f"{point}: the daemon never got to {where}"
        d.kill()  # kill -9 while it is held there
    disarm()
    saver.join(30)
    assert not saver.is_alive()
    assert d.proc.poll() is not None  # it was killed (rank-copy: from inside the copy)
    handle = handles[0]
    assert handle.wait(10) is handle  # the training loop is not interrupted
    # a daemon killed after its marker landed committed the step: the handle says so (storage holds it)
    assert handle.state is (StepState.COMMITTED if where.marker_landed else StepState.FAILED), (point, handle)

    verified = asyncio.run(_verify_all(root, opts))
    assert 2 in verified and verified[2] > 0
    # committed exactly when its marker was written before the kill, and then whole
    assert (KILLED in verified) == where.marker_landed, (point, sorted(verified))
    if where.marker_landed:
        assert verified[KILLED] > 0
        _loads(root, KILLED, opts)
    _loads(root, 2, opts)  # the previous step always loads

    journal = Path(journal_path(d.socket))
    in_flight = [e["step"] for e in json.loads(journal.read_text())["steps"]] if journal.exists() else []
    # rank-copy: the save announced its step before the copy (PrepareStep), so the daemon may have started
    # it (in flight, abandoned below) or not yet (killed first); either way it never had the save's data
    assert not where.rank_copy or asyncio.run(_parts(root, opts, KILLED)) == {}
    # training goes on: a restarted daemon abandons what the dead one had in flight, takes the next step
    start()
    notes = asyncio.run(_failure_notes(root, opts, in_flight))
    assert all(n.get("abandoned") for n in notes.values()) and len(notes) == len(
        [s for s in in_flight if s not in verified]), (in_flight, notes)
    client.save(4, _state(4)).wait(60)
    _loads(root, 4, opts)
    assert all(n > 0 for n in asyncio.run(_verify_all(root, opts)).values())
    client.close()


def _params(backend: str, points: dict[str, Point]) -> list[Any]:
    return [p if (backend, p) in DEFAULT_RUN else pytest.param(p, marks=pytest.mark.slow) for p in points]


@pytest.mark.s3
@pytest.mark.usefixtures("in_aws_env")
@pytest.mark.parametrize("point", _params("s3", S3_POINTS))
def test_kill_9_at_s3(point: str, s3: S3Server, proxy: FaultProxy, start_daemon) -> None:
    where = S3_POINTS[point]
    root = f"s3://{BUCKET}/kill-{point}"
    flags = (*s3_flags(proxy.url), "--chunk-bytes", "64KiB", "--keep", "2", "--stage-grace", "0")

    def arm() -> None:
        proxy.reset_stats()
        if where.path:
            proxy.set_faults(fail_all="stall", stall_s=60, max_faults=1, path_regex=where.path,
                             methods=list(where.methods) if where.methods else None)

    _run_point(point, where, root, options(s3.endpoint_url), lambda: start_daemon(root, point, *flags, env=aws_env(s3)),
               arm, lambda: proxy.stats().faults.get("stall", 0) >= 1, proxy.clear_faults)


@pytest.mark.parametrize("point", _params("local", LOCAL_POINTS))
def test_kill_9_at_local(point: str, tmp_path: Path, start_daemon) -> None:
    where = LOCAL_POINTS[point]
    root = str(tmp_path / "ckpt")
    flags = ("--chunk-bytes", "64KiB", "--keep", "2", "--stage-grace", "0")
    step = Path(root) / step_dir(KILLED)

    def arm() -> None:
        if where.fifo:
            (step / where.fifo).parent.mkdir(parents=True)
            os.mkfifo(step / where.fifo)

    def reached() -> bool:  # every other chunk of the array landed: the daemon is blocked on the pipe
        chunks = step / Path(where.fifo).parent
        return len([p for p in chunks.iterdir() if p.is_file()]) == 7

    _run_point(point, where, root, None, lambda: start_daemon(root, point, *flags), arm, reached, lambda: None)
