"""A step of two nodes whose node daemon is lost after it wrote its node's part: the save is not lost.

On any node but the coordinator's (node 0) the part is durable and the coordinator still commits the step
once every part is in, so the rank's handle must not report a lost save (nor raise one under
``on_daemon_lost="raise"``): it waits for the commit through storage, as long as the daemons wait for
theirs (``--commit-timeout``, told in the daemon's welcome), and reports what the coordinator decided. On
the coordinator's own node nobody is left to commit, and the handle fails at once, saying why.

Two daemons on one root stand for two nodes (``Placement``'s node index); the kill waits until the node's
part is on disk.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, DaemonUnavailableError, Placement, StepState
from ckptd.client.reader import load
from ckptd.client.state import Shard
from ckptd.testing.fixtures import wait_for
from ckptd.writer.errors import SaveTimeoutError, ShardLayoutError
from ckptd.writer.format import commit_marker, part_key

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 60.0


def _rank(socket: str, rank: int, policy: str = "raise") -> CheckpointClient:
    return CheckpointClient(socket, placement=Placement(rank, 2, 1, rank), timeout_s=TIMEOUT_S,
                            on_daemon_lost=policy)  # type: ignore[arg-type]


def _state(rank: int, data: torch.Tensor) -> dict[str, Shard]:
    return {"x": Shard.per_rank("x", data, rank, 2)}


def _node1_part_then_kill(start_daemon, root: Path, *flags: str) -> tuple[CheckpointClient, object, torch.Tensor]:
    d1 = start_daemon(str(root), "d1", *flags)
    c1 = _rank(d1.socket, 1)
    data = torch.arange(100.0) + 1
    handle = c1.save(1, _state(1, data))
    wait_for(lambda: (root / part_key(1, 1)).exists(), "node 1's part")
    d1.kill()
    return c1, handle, data


def test_a_node_that_lost_its_daemon_after_its_part_reports_the_coordinators_commit(start_daemon, tmp_path):
    root = tmp_path / "ckpt"
    d0 = start_daemon(str(root), "d0")
    c1, h1, data1 = _node1_part_then_kill(start_daemon, root)
    assert not h1.done() and h1.state is StepState.DURABLE and h1.durable()  # not lost: waiting for node 0
    c0 = _rank(d0.socket, 0)
    data0 = torch.arange(100.0)
    assert c0.save(1, _state(0, data0)).wait(60).state is StepState.COMMITTED
    assert h1.wait(30) is h1 and h1.state is StepState.COMMITTED and h1.exception() is None  # no raise
    assert (root / commit_marker(1)).exists()
    for rank, data in ((0, data0), (1, data1)):
        template = _state(rank, torch.zeros(100))
        load(str(root), 1, template, rank=rank)
        assert torch.equal(template["x"].data[0], data), rank
    c0.close()
    c1.close()


def test_the_coordinators_refusal_reaches_the_node_that_lost_its_daemon(start_daemon, tmp_path):
    root = tmp_path / "ckpt"
    d0 = start_daemon(str(root), "d0")
    c1, h1, _ = _node1_part_then_kill(start_daemon, root)
    c0 = _rank(d0.socket, 0)
    with pytest.raises(ShardLayoutError, match="ranks disagree"):
        c0.save(1, _state(0, torch.arange(100, dtype=torch.float64))).wait(60)  # another dtype than node 1's
    with pytest.raises(ShardLayoutError, match="failed on the coordinator"):  # not a lost daemon: raised
        h1.wait(30)
    assert not (root / commit_marker(1)).exists()
    c0.close()
    c1.close()


def test_the_wait_for_the_coordinator_is_bounded_by_the_commit_timeout(start_daemon, tmp_path):
    root = tmp_path / "ckpt"
    c1, h1, _ = _node1_part_then_kill(start_daemon, root, "--commit-timeout", "3")  # node 0 never saves
    t0, cpu0 = time.monotonic(), time.process_time()
    with pytest.raises(DaemonUnavailableError, match="did not commit within 3s"):
        h1.wait(60)
    assert time.monotonic() - t0 < 30
    assert time.process_time() - cpu0 < 1.5, "the wait spins"  # it sleeps between asks of storage
    assert h1.state is StepState.FAILED
    c1.close()


def test_the_coordinators_node_that_lost_its_daemon_fails_at_once(start_daemon, tmp_path):
    root = tmp_path / "ckpt"
    d0 = start_daemon(str(root), "d0")
    c0 = _rank(d0.socket, 0)
    handle = c0.save(1, _state(0, torch.arange(100.0)))  # node 1 never saves: node 0 waits for its part
    wait_for(lambda: (root / part_key(1, 0)).exists(), "node 0's part")
    d0.kill()
    with pytest.raises(DaemonUnavailableError, match="its daemon was to commit the step"):
        handle.wait(30)
    c0.close()


def test_a_restarted_node_daemon_does_not_turn_the_coordinators_commit_into_a_lost_save(start_daemon, tmp_path):
    """Node 1's daemon is restarted (systemd, or the embedded mode on the next save) after its part was
    written: the new daemon has no record of the save, but the part is durable and node 0 commits the step.
    The next save must not raise it as an earlier failure, and the handle reports the commit."""
    root = tmp_path / "ckpt"
    d0 = start_daemon(str(root), "d0")
    c1, h1, data1 = _node1_part_then_kill(start_daemon, root)
    start_daemon(str(root), "d1")  # the same socket
    h2 = c1.save(2, _state(1, data1 + 1))  # no raise: step 1 is not lost
    c0 = _rank(d0.socket, 0)
    c0.save(1, _state(0, torch.arange(100.0))).wait(60)
    assert h1.wait(30).state is StepState.COMMITTED and h1.exception() is None
    c0.save(2, _state(0, torch.arange(100.0) + 1)).wait(60)
    assert h2.wait(60).state is StepState.COMMITTED
    c0.close()
    c1.close()


def test_a_node_that_stops_waiting_keeps_the_coordinator_from_committing_later(start_daemon, tmp_path, monkeypatch):
    """A named attempt (one run's saves): at the end of its wait the handle claims the step's verdict, as its
    daemon would have at its commit timeout, so a coordinator that comes later does not commit a step this
    rank was told is lost."""
    monkeypatch.setenv("CKPTD_INCARNATION", "run-a")
    root = tmp_path / "ckpt"
    c1, h1, _ = _node1_part_then_kill(start_daemon, root, "--commit-timeout", "3")
    assert h1.attempt.startswith("run-a.")
    with pytest.raises(DaemonUnavailableError, match="this rank stopped waiting first, so the coordinator will not"):
        h1.wait(60)
    d0 = start_daemon(str(root), "d0")  # node 0 comes late
    c0 = _rank(d0.socket, 0)
    with pytest.raises(SaveTimeoutError, match="node 1 stopped waiting"):
        c0.save(1, _state(0, torch.arange(100.0))).wait(60)
    assert not (root / commit_marker(1)).exists()
    c0.close()
    c1.close()


def test_a_node_that_finds_the_coordinators_verdict_to_commit_waits_for_its_marker(start_daemon, tmp_path,
                                                                                  monkeypatch):
    """The coordinator claimed the verdict to commit before the handle's wait ended (its marker is its next
    write, late): the handle waits on and reports the commit."""
    import asyncio

    from ckptd.writer.root import open_root

    monkeypatch.setenv("CKPTD_INCARNATION", "run-b")
    root = tmp_path / "ckpt"
    c1, h1, _ = _node1_part_then_kill(start_daemon, root, "--commit-timeout", "3")

    async def claim() -> object:
        async with open_root(str(root), None) as ckpt:
            return await ckpt.claim_verdict(1, h1.attempt, "commit", node=0)

    assert asyncio.run(claim()) is None  # the coordinator's claim decided it
    wait_for(lambda: not h1.done() and h1._verdict_seen, "the handle's wait to end", timeout=30)
    assert not h1.done() and h1.state is StepState.DURABLE
    d0 = start_daemon(str(root), "d0")
    c0 = _rank(d0.socket, 0)
    assert c0.save(1, _state(0, torch.arange(100.0))).wait(60).state is StepState.COMMITTED
    assert h1.wait(30).state is StepState.COMMITTED
    c0.close()
    c1.close()


def test_storage_without_an_atomic_create_decides_nothing_at_the_end_of_the_wait(tmp_path, monkeypatch):
    """Where the backend cannot create an object once (a server without conditional PUTs), two claims of
    a verdict could both win: the handle claims nothing there, and says the coordinator may still commit."""
    import asyncio
    import dataclasses

    from ckptd.client.reader import stop_waiting_async
    from ckptd.writer.format import verdict_key
    from ckptd.writer.root import open_root

    async def go() -> tuple[object, bool, object]:
        async with open_root(str(tmp_path / "root"), None, create=True) as ckpt:
            caps = ckpt.backend.capabilities
            monkeypatch.setattr(ckpt.backend, "capabilities", dataclasses.replace(caps, atomic_create=False))
            standing = await stop_waiting_async(ckpt, 1, 1, "run-c.1")
            claimed = await ckpt.backend.exists(verdict_key(1, "run-c.1"))
            await ckpt.claim_verdict(2, "run-c.1", "commit", node=0)  # the coordinator's, as it still makes it
            return standing, claimed, await stop_waiting_async(ckpt, 2, 1, "run-c.1")

    standing, claimed, commit = asyncio.run(go())
    assert (standing, claimed) == ({"verdict": "unknown"}, False)
    assert isinstance(commit, dict) and commit["verdict"] == "commit"  # what stands is read: the wait goes on
