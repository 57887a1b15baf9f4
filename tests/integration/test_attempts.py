"""A step saved again by restarted ranks is committed from that attempt's bytes only (client/attempts.py).

Real daemons on a local root; each "run" of the trainer is a set of clients made under its own
``CKPTD_INCARNATION`` (what the process group's store gives a restarted job). The ranks of the first run
die part-way through a save; the second run saves the same step with other values. Before attempts were
named, the coordinator committed the surviving node's part of the dead run beside the new run's part, and
a restarted rank joined its node's unfinished attempt of the dead ranks.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, Placement, Shard, StepState
from ckptd.client.protocol import PROTOCOL_VERSION, RestoreReply, RestoreRequest
from ckptd.client.reader import load
from ckptd.testing.fixtures import wait_for
from ckptd.testing.launch import run_ranks
from ckptd.writer.errors import DuplicateSaveError, SaveTimeoutError, StepFailedError

pytestmark = pytest.mark.timeout(120)
# Node 1's --commit-timeout: run A's attempt there ends by it, and run B's must commit within it. Run B's
# coordinator polls for node 1's part up to a second apart by then, then writes the metadata and syncs the
# filesystem before its marker: 3 s left little room for that on a loaded runner. (Under SUPERSEDE_WAIT_S, 20 s,
# which a rank of run B waits at most for run A's attempt to end on its node.)
N1_COMMIT_TIMEOUT_S = 10


def _state(run: str, rank: int) -> dict[str, Shard]:
    g = torch.Generator().manual_seed(zlib.crc32(f"{run}/{rank}".encode()))
    t = torch.randn(4096, generator=g)
    return {f"r{rank}/w": Shard(f"r{rank}/w", t, tuple(t.shape), (0,))}


def _client(monkeypatch: pytest.MonkeyPatch, run: str, sock: str, placement: Placement) -> CheckpointClient:
    monkeypatch.setenv("CKPTD_INCARNATION", run)
    return CheckpointClient(sock, placement=placement, timeout_s=60)


def _part(root: Path, step: int, node: int) -> dict[str, object]:
    return dict(json.loads((root / f"step_{step}" / "_ckptd" / "_parts" / f"node-{node}.json").read_text()))




def _loaded(root: Path, step: int, ranks: list[int]) -> dict[str, torch.Tensor]:
    template = {f"r{r}/w": torch.zeros(4096) for r in ranks}
    load(str(root), step, template)
    return template


def test_coordinator_never_commits_another_attempts_part(start_daemon, tmp_path, monkeypatch):
    """Node 1's part of the dead run is on storage when the new run's coordinator reaches the commit: it
    waits for node 1's part of the new run instead of committing the stale one."""
    root = tmp_path / "ckpt"
    n0 = start_daemon(str(root), "n0", "--stage-grace", "0", arena="64MiB")
    n1 = start_daemon(str(root), "n1", "--stage-grace", "0", "--commit-timeout", str(N1_COMMIT_TIMEOUT_S),
                      arena="64MiB")
    # run A: node 1's rank saves step 2; node 0's rank died before its save
    old = _client(monkeypatch, "runA", n1.socket, Placement(1, 2, 1, 1))
    stale = old.save(2, _state("A", 1))
    wait_for(lambda: (root / "step_2" / "_ckptd" / "_parts" / "node-1.json").exists(), "run A's part", 30)
    assert _part(root, 2, 1)["attempt"] == "runA.1"

    # run B: node 0 first; its coordinator finds only run A's part of node 1 and must not take it
    new = {r: _client(monkeypatch, "runB", d.socket, Placement(r, 2, 1, r)) for r, d in ((0, n0), (1, n1))}
    first = new[0].save(2, _state("B", 0))
    # its coordinator found run A's part of node 1 (node 0's part written first: no fixed sleep covers that on a
    # loaded runner) and waits on; nothing of run B reached node 1 yet, so nothing may be committed
    wait_for(lambda: "from attempt runA.1, not this one (runB.1)" in n0.log_tail(), "node 0's coordinator", 60)
    assert not (root / "step_2" / "_ckptd" / "COMMITTED").exists()
    # node 1's new rank waits for run A to end there (its commit timeout), then saves run B's bytes
    with pytest.raises(SaveTimeoutError):
        stale.wait(30)
    second = new[1].save(2, _state("B", 1))
    assert first.wait(60).state is StepState.COMMITTED and second.wait(60).state is StepState.COMMITTED

    commit = json.loads((root / "step_2" / "_ckptd" / "COMMITTED").read_text())
    assert commit["attempts"] == ["runB.1", "runB.1"]
    got = _loaded(root, 2, [0, 1])
    for r in (0, 1):
        assert torch.equal(got[f"r{r}/w"], _state("B", r)[f"r{r}/w"].data), f"rank {r}: not run B's bytes"
    for c in (old, *new.values()):
        c.close()


def test_restarted_ranks_give_up_their_nodes_unfinished_attempt(start_daemon, tmp_path, monkeypatch):
    """One node, two ranks; run A's rank 1 died before saving step 3. Run B's ranks save step 3: the first
    of them gives run A's attempt up at once (not after --part-timeout) and never joins it."""
    root = tmp_path / "ckpt"
    d = start_daemon(str(root), "d0", "--stage-grace", "0", arena="64MiB")
    old = _client(monkeypatch, "runA", d.socket, Placement(0, 2, 2, 0))
    stale = old.save(3, _state("A", 0))
    new = {r: _client(monkeypatch, "runB", d.socket, Placement(r, 2, 2, 0)) for r in (0, 1)}
    t0 = time.monotonic()
    # run B's rank 1 first: joined to run A's attempt it would complete it with run A's rank 0 bytes
    handles = [new[1].save(3, _state("B", 1)), new[0].save(3, _state("B", 0))]
    with pytest.raises(StepFailedError, match=r"attempt runA\.1 given up: rank 1 started attempt runB\.1"):
        stale.wait(30)
    assert all(h.wait(60).state is StepState.COMMITTED for h in handles)
    assert time.monotonic() - t0 < 30  # not the 600 s part timeout
    got = _loaded(root, 3, [0, 1])
    for r in (0, 1):
        assert torch.equal(got[f"r{r}/w"], _state("B", r)[f"r{r}/w"].data), f"rank {r}: not run B's bytes"
    for c in (old, *new.values()):
        c.close()


def test_a_retry_by_the_same_ranks_is_the_next_attempt(start_daemon, tmp_path, monkeypatch):
    """Same processes, the save of a step that failed is saved again: attempt ``.2``, committed, and served
    from the daemon's memory without the failed attempt's bytes."""
    root = tmp_path / "ckpt"
    d = start_daemon(str(root), "d0", "--stage-grace", "0", "--part-timeout", "1", arena="64MiB")
    ranks = {r: _client(monkeypatch, "runC", d.socket, Placement(r, 2, 2, 0)) for r in (0, 1)}
    failed = ranks[0].save(4, _state("C1", 0))  # rank 1 misses this save: the part timeout fails it
    with pytest.raises(SaveTimeoutError):
        failed.wait(30)
    with pytest.raises(SaveTimeoutError):  # rank 1's first save of step 4 was meant for that attempt
        ranks[1].save(4, _state("C1", 1))
    retry = [ranks[r].save(4, _state("C2", r)) for r in (0, 1)]
    assert all(h.wait(60).state is StepState.COMMITTED for h in retry)
    assert _part(root, 4, 0)["attempt"] == "runC.2"
    # what the failed attempt kept in the arena (rank 0's written shard) is not served with the new one's
    reply = ranks[0]._request(RestoreRequest(v=PROTOCOL_VERSION, step=4))
    assert isinstance(reply, RestoreReply) and sorted(s.key for s in reply.shards) == ["r0/w", "r1/w"]
    got = _loaded(root, 4, [0, 1])
    for r in (0, 1):
        assert torch.equal(got[f"r{r}/w"], _state("C2", r)[f"r{r}/w"].data)
    for c in ranks.values():
        c.close()


def _save_step_2(rank: int, world: int, sockets: list[str], run: str, saving: list[int]) -> str:
    """A rank of a real gloo job (one rank a node): its save of step 2, if it saves in this run, and its
    attempt's name as the client made it (the incarnation agreed through the process group's store)."""
    client = CheckpointClient(sockets[rank], timeout_s=60)  # placement from torchrun's variables
    try:
        if rank not in saving:
            return ""
        handle = client.save(2, _state(run, rank))
        if len(saving) < world:  # the others died: this rank's part lands, the step never commits
            wait_for(handle.durable, "this node's part", 30)
        else:
            handle.wait(60)
        return handle.attempt
    finally:
        client.close()


@pytest.mark.timeout(300)  # two launches of gloo ranks, four daemon stops: over 120 s on a heavily loaded runner
def test_a_restarted_gloo_job_names_its_attempt_through_the_process_group(start_daemon, tmp_path):
    """The same as the first test without ``CKPTD_INCARNATION``: two real gloo jobs, one after the other;
    each agrees on its own incarnation through its process group's store."""
    root = tmp_path / "ckpt"
    n0 = start_daemon(str(root), "n0", "--stage-grace", "0", arena="64MiB")
    n1 = start_daemon(str(root), "n1", "--stage-grace", "0", "--commit-timeout", str(N1_COMMIT_TIMEOUT_S),
                      arena="64MiB")
    sockets = [n0.socket, n1.socket]
    env = {"CKPTD_INCARNATION": ""}
    first = run_ranks(_save_step_2, 2, sockets, "A", [1], local_world_size=1, env=env)
    stale = _part(root, 2, 1)["attempt"]
    assert first[1] == stale and stale.endswith(".1") and len(stale) == 18, first  # 16 hex digits, ".1"
    second = run_ranks(_save_step_2, 2, sockets, "B", [0, 1], local_world_size=1, env=env)
    assert second[0] == second[1] != stale and second[0].endswith(".1"), (first, second)
    commit = json.loads((root / "step_2" / "_ckptd" / "COMMITTED").read_text())
    assert commit["attempts"] == [second[0], second[0]]
    got = _loaded(root, 2, [0, 1])
    for r in (0, 1):
        assert torch.equal(got[f"r{r}/w"], _state("B", r)[f"r{r}/w"].data), f"rank {r}: not run B's bytes"


def test_a_second_save_call_of_a_step_in_flight_is_refused(start_daemon, tmp_path, monkeypatch):
    """Rank 0 calls save(5) again while its first save of step 5 waits for rank 1 (through the same client,
    and through another client of the process for the same rank and daemon): refused with
    DuplicateSaveError before anything is sent (as a new attempt it would give up the one rank 1 joins);
    the first save then commits with rank 1's, from the first call's bytes. (After a failed save, calling
    save again is a retry: the test above.)"""
    root = tmp_path / "ckpt"
    d = start_daemon(str(root), "d0", "--stage-grace", "0", arena="64MiB")
    ranks = {r: _client(monkeypatch, "runD", d.socket, Placement(r, 2, 2, 0)) for r in (0, 1)}
    first = ranks[0].save(5, _state("D1", 0))
    with pytest.raises(DuplicateSaveError, match=r"step 5 is already being saved by this process \(attempt runD\.1"):
        ranks[0].save(5, _state("D2", 0))
    again = _client(monkeypatch, "runD", d.socket, Placement(0, 2, 2, 0))  # another client, same rank
    with again, pytest.raises(DuplicateSaveError, match="step 5 is already being saved by this process"):
        again.save(5, _state("D2", 0))
    second = ranks[1].save(5, _state("D1", 1))
    assert first.wait(60).state is StepState.COMMITTED and second.wait(60).state is StepState.COMMITTED
    assert _part(root, 5, 0)["attempt"] == "runD.1"
    got = _loaded(root, 5, [0, 1])
    for r in (0, 1):
        assert torch.equal(got[f"r{r}/w"], _state("D1", r)[f"r{r}/w"].data)
    for c in ranks.values():
        c.close()


def test_a_second_megatron_style_save_call_of_a_step_in_flight_is_refused(start_daemon, tmp_path, monkeypatch):
    """The same through the Megatron save's way in: a plan's static bytes copied ahead into the lease granted
    with the previous save, and the step announced (``PrepareStep``) before the save proper. The second call
    must be refused before it announces a new attempt, which would give up the first one rank 1 joins."""
    from ckptd.client.early import copied_ahead
    from ckptd.client.planbuild import build_stage_plan

    d = start_daemon(str(tmp_path / "ckpt"), "d0", "--stage-grace", "0", arena="64MiB")
    ranks = {r: _client(monkeypatch, "runE", d.socket, Placement(r, 2, 2, 0)) for r in (0, 1)}
    plans = {r: build_stage_plan(list(_state("E", r).values())) for r in (0, 1)}
    assert plans[0].has_static
    for r in (0, 1):  # step 4 committed through the plans: each rank holds a lease granted ahead
        ranks[r].save_staged(4, plans[r], [], {})
    first = ranks[0].save_staged(5, plans[0], [], {})  # rank 1 has not saved step 5 yet
    with (pytest.raises(DuplicateSaveError, match="step 5 is already being saved by this process"),
          ranks[0].one_save_call(5), copied_ahead(ranks[0], plans[0], 5, prepare=True) as early):
        ranks[0].save_staged(5, plans[0], [], {}, early=early)
    second = ranks[1].save_staged(5, plans[1], [], {})
    assert first.wait(60).state is StepState.COMMITTED and second.wait(60).state is StepState.COMMITTED
    for c in ranks.values():
        c.close()
