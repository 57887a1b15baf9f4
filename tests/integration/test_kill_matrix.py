"""Kill matrix: ``kill -9`` of the daemon at many precise points of a save, on S3.

The fault proxy freezes the daemon at one request (a ``stall`` fault selected by method and path), the
test waits until that request is held, then kills the daemon. Afterwards, for every point:

- no corrupt or half-visible step: every committed step verifies chunk by chunk against its crc32c;
  the killed step is committed exactly when the kill came after its marker (and then it verifies too);
- the previous step loads bit-exact;
- the training loop keeps going: the killed save's handle reports ``FAILED`` without raising
  (``on_daemon_lost="warn"``), a restarted daemon takes the next step, and it commits.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote

import pytest
import torch
from test_s3 import aws_env, in_aws_env, options, s3_flags  # noqa: F401 (fixture)

from ckptd.client import CheckpointClient, Placement, SaveHandle, StepState
from ckptd.client.reader import load
from ckptd.testing.faultproxy import FaultProxy
from ckptd.testing.fixtures import BUCKET
from ckptd.testing.s3server import S3Server
from ckptd.writer.arrays import verify_array
from ckptd.writer.format import commit_marker, latest_key, part_key, parts_dir, sidecar_key, step_dir
from ckptd.writer.root import open_root

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180), pytest.mark.usefixtures("in_aws_env")]

KILLED = 3  # steps 1 and 2 commit first (retention with --keep 2 then has a step to delete)


@dataclass(frozen=True)
class Point:
    path: str  # regex on the request target
    methods: tuple[str, ...] | None = None
    marker_landed: bool = False  # the kill comes after the COMMITTED write: the step must be committed


POINTS = {
    # accept: the daemon checks the step is not committed yet; the rank is blocked in save()
    "accept-commit-check": Point(rf"/{re.escape(commit_marker(KILLED))}", ("HEAD", "GET")),
    "accept-sidecar": Point(rf"/{re.escape(sidecar_key(''))}[0-9a-f]+\.json", ("PUT",)),
    "first-chunk": Point(rf"/step_{KILLED}/model/w/c/0(\?|$)", ("PUT",)),
    "later-chunk": Point(rf"/step_{KILLED}/model/w/c/5(\?|$)", ("PUT",)),
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


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "model/w": torch.randn(8 * 16 * 1024, generator=g),  # 512 KiB: eight 64 KiB chunks
        "model/b": torch.randn(33, generator=g),  # small: packed into one object on S3
    }


def _loads(root: str, step: int, endpoint: str) -> None:
    want = _state(step)
    template = {k: torch.zeros_like(v) for k, v in want.items()}
    load(root, step, template, storage_options=options(endpoint))
    for k, v in want.items():
        assert torch.equal(template[k], v), (step, k)


async def _verify_all(root: str, endpoint: str) -> dict[int, int]:
    """Every committed step re-read and checked against its checksums: step -> bytes verified."""
    out = {}
    async with open_root(root, options(endpoint), create=False) as r:
        for step in await r.committed_steps():
            commit = await r.read_commit(step)
            out[step] = sum([await verify_array(r.store, step_dir(step), rec) for rec in commit.arrays])
    return out


def _wait_stalled(proxy: FaultProxy, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proxy.stats().faults.get("stall", 0) >= 1:
            return True
        time.sleep(0.02)
    return False


# The default run kills at one point of each phase (staging, data, part, commit, after the marker); the
# rest run with -m slow.
DEFAULT_RUN = {"accept-commit-check", "later-chunk", "part-manifest", "marker", "latest"}


@pytest.mark.parametrize(
    "point", [p if p in DEFAULT_RUN else pytest.param(p, marks=pytest.mark.slow) for p in POINTS]
)
def test_kill_9_at(point: str, s3: S3Server, proxy: FaultProxy, start_daemon) -> None:
    where = POINTS[point]
    root = f"s3://{BUCKET}/kill-{point}"
    flags = (*s3_flags(proxy.url), "--chunk-bytes", "64KiB", "--keep", "2", "--stage-grace", "0")
    d = start_daemon(root, point, *flags, env=aws_env(s3))
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
    for step in (1, 2):
        client.save(step, _state(step)).wait(60)

    proxy.reset_stats()
    proxy.set_faults(fail_all="stall", stall_s=60, max_faults=1, path_regex=where.path,
                     methods=list(where.methods) if where.methods else None)
    handles: list[SaveHandle] = []
    sidecar = json.dumps({"point": point})  # a new sidecar: written while the save is accepted
    saver = threading.Thread(target=lambda: handles.append(client.save(KILLED, _state(KILLED), sidecars=[sidecar])))
    saver.start()
    assert _wait_stalled(proxy, 30), f"{point}: the daemon never made the request {where}"
    d.kill()  # kill -9 while the request is held
    proxy.clear_faults()
    saver.join(30)
    assert not saver.is_alive()
    handle = handles[0]
    assert handle.wait(10) is handle  # the training loop is not interrupted
    assert handle.state is StepState.FAILED

    verified = asyncio.run(_verify_all(root, s3.endpoint_url))
    assert 2 in verified and verified[2] > 0
    # committed exactly when its marker was written before the kill, and then whole
    assert (KILLED in verified) == where.marker_landed, (point, sorted(verified))
    if where.marker_landed:
        assert verified[KILLED] > 0
        _loads(root, KILLED, s3.endpoint_url)
    _loads(root, 2, s3.endpoint_url)  # the previous step always loads

    # training goes on: a restarted daemon takes the next step
    start_daemon(root, point, *flags, env=aws_env(s3))
    client.save(4, _state(4)).wait(60)
    _loads(root, 4, s3.endpoint_url)
    assert all(n > 0 for n in asyncio.run(_verify_all(root, s3.endpoint_url)).values())
    client.close()
