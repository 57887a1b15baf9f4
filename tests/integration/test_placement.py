"""Placement and ownership end to end: 2 "nodes" x 2 ranks under Ray- and SLURM-style environments (one
daemon per node, one root), the client's root check, one socket per root, and the embedded daemon's life:
reused while it lives, gone after its job, never reused once dead."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_pipeline import expected_state, tensors, zero_template

from ckptd.client import CheckpointClient, Placement, RootMismatchError
from ckptd.client.paths import default_socket_path
from ckptd.client.reader import load, read_commit
from ckptd.testing.launch import run_ranks

pytestmark = pytest.mark.timeout(120)
EMBEDDED = ["--arena-size", "16MiB", "--no-prefault"]


def _rank_save(rank: int, world: int, root: str, sockets: list[str]) -> tuple[int, int, int, int]:
    p = Placement.detect(os.environ)  # what CheckpointClient does by default, read here to pick the node's socket
    client = CheckpointClient(sockets[p.node], root=root)
    handle = client.save(1, expected_state(rank, world, 1))
    torch.distributed.barrier()
    handle.wait(timeout=60)
    client.close()
    return client.placement.rank, client.placement.local_world_size, client.placement.node, client.placement.num_nodes


@pytest.mark.parametrize("launcher", ["ray", "slurm"])
def test_two_nodes_of_two_ranks_commit_under_ray_and_slurm(launcher: str, start_daemon, tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    d0, d1 = start_daemon(root, "node0"), start_daemon(root, "node1")
    got = run_ranks(_rank_save, 4, root, [d0.socket, d1.socket], local_world_size=2, launcher=launcher)
    assert got == [(0, 2, 0, 2), (1, 2, 0, 2), (2, 2, 1, 2), (3, 2, 1, 2)]
    commit = read_commit(root, 1)
    assert (commit.num_nodes, commit.world_size) == (2, 4)
    for rank in (0, 3):  # one rank of each node reads back what it saved
        template = zero_template(rank, 4)
        load(root, 1, template, rank=rank)
        want, have = tensors(expected_state(rank, 4, 1)), tensors(template)
        assert all(torch.equal(want[k], have[k]) for k in want)


def test_a_daemon_of_another_root_is_refused(start_daemon, tmp_path: Path) -> None:
    d = start_daemon(str(tmp_path / "a"))
    with pytest.raises(RootMismatchError) as err:
        CheckpointClient(d.socket, root=str(tmp_path / "b"), placement=Placement(0, 1, 1, 0))
    assert str(tmp_path / "a") in str(err.value) and str(tmp_path / "b") in str(err.value)
    ok = CheckpointClient(d.socket, root=str(tmp_path / "a") + "/./", placement=Placement(0, 1, 1, 0))
    assert ok.root == str(tmp_path / "a") + "/./"
    ok.close()


@pytest.fixture
def runtime_dir(sockdir: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("XDG_RUNTIME_DIR", sockdir)
    monkeypatch.delenv("CKPTD_SOCKET", raising=False)
    yield sockdir


def _reaped(pid: int, timeout: float) -> bool:
    """Whether our child ``pid`` exited within ``timeout`` (reaping it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return True
        time.sleep(0.1)
    return False


def _save_one(client: CheckpointClient, step: int) -> None:
    client.save(step, {"w": torch.full((4, 4), float(step))}).wait(timeout=30)


def test_embedded_daemons_one_per_root_reused_while_alive_and_gone_after_the_job(
    runtime_dir: str, tmp_path: Path
) -> None:
    args = [*EMBEDDED, "--exit-when-idle", "1.5"]
    a = CheckpointClient(root=str(tmp_path / "actor"), start_daemon=True, daemon_args=args)
    c = CheckpointClient(root=str(tmp_path / "critic"), start_daemon=True, daemon_args=args)
    assert a.socket_path == default_socket_path(os.environ, str(tmp_path / "actor")) != c.socket_path
    assert a._welcome is not None and c._welcome is not None
    pids = a._welcome.daemon_pid, c._welcome.daemon_pid
    assert pids[0] != pids[1]
    _save_one(a, 1)
    _save_one(c, 1)  # same step number, other root: no collision
    again = CheckpointClient(root=str(tmp_path / "actor"), start_daemon=True, daemon_args=args)
    assert again._welcome is not None and again._welcome.daemon_pid == pids[0]  # alive, same root: reused
    for client in (a, c, again):
        client.close()
    assert all(_reaped(pid, 15) for pid in pids)  # the job's clients are gone, its steps committed
    assert not os.path.exists(a.socket_path) and not os.path.exists(c.socket_path)
    assert read_commit(str(tmp_path / "actor"), 1).step == read_commit(str(tmp_path / "critic"), 1).step == 1


def test_a_dead_daemon_is_replaced_not_reused(runtime_dir: str, tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    first = CheckpointClient(root=root, start_daemon=True, daemon_args=[*EMBEDDED, "--exit-when-idle", "30"])
    assert first._welcome is not None
    old = first._welcome.daemon_pid
    _save_one(first, 1)
    first.close()
    os.kill(old, signal.SIGKILL)  # the job died hard: its daemon too, its socket file stays behind
    assert _reaped(old, 10) and os.path.exists(first.socket_path)
    second = CheckpointClient(root=root, start_daemon=True, daemon_args=[*EMBEDDED, "--exit-when-idle", "1"])
    assert second._welcome is not None and second._welcome.daemon_pid != old
    _save_one(second, 2)
    second.close()
    assert _reaped(second._welcome.daemon_pid, 15)
    assert read_commit(root, "latest").step == 2
