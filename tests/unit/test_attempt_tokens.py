"""Attempt tokens (client/attempts.py) and how the commit protocol reads them: the ranks of one run agree on
the incarnation through the process group's store; a failure note or a part of another attempt is not
taken for this attempt's."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ckptd.client.attempts import STORE_KEY, Attempts, valid_token
from ckptd.writer import format as fmt
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import ConfigError, SaveTimeoutError, StepCommittedError, StepFailedError


def test_tokens_count_the_saves_of_each_step() -> None:
    a = Attempts({"CKPTD_INCARNATION": "run-7"})
    assert [a.next(5), a.next(6), a.next(5)] == ["run-7.1", "run-7.1", "run-7.2"]
    with a.one_call(5):  # a call that tries again inside itself keeps its token; the next call takes a new one
        assert [a.next(5), a.next(5)] == ["run-7.3", "run-7.3"]
        assert a.next(6) == "run-7.2"  # another step's save inside it is a call of its own
    assert a.next(5) == "run-7.4"
    for step in range(100, 400):  # many other steps saved in between: step 5's count is still known
        a.next(step)
    assert a.next(5) == "run-7.5"
    again = Attempts({"CKPTD_INCARNATION": "run-7"})  # a client made anew in the same process goes on counting
    assert again.next(5) == "run-7.6" and Attempts({"CKPTD_INCARNATION": "run-7"}, rank=1).next(5) == "run-7.1"
    with a.one_call(7), a.one_call(7):  # an outer retrying call around an inner one: one token
        assert [a.next(7), a.next(7)] == ["run-7.1", "run-7.1"]
    assert Attempts({}).next(5) == ""  # no incarnation, no process group: unnamed, as before
    with pytest.raises(ConfigError, match="CKPTD_INCARNATION"):
        Attempts({"CKPTD_INCARNATION": "a b"})
    assert valid_token("") and valid_token("x.1") and not valid_token("x/1") and not valid_token("x" * 97)


def _agree(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        token = Attempts({}).next(3)
        with open(f"{out}.{rank}", "w") as f:
            f.write(token)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_ranks_of_one_run_agree_on_the_incarnation(tmp_path: Path) -> None:
    """Two gloo ranks, each its own random token: one ``compare_set`` each, and both use the first one set."""
    from ckptd.testing.launch import free_port

    out = str(tmp_path / "token")
    mp.spawn(_agree, args=(free_port(), out), nprocs=2)
    tokens = [Path(f"{out}.{r}").read_text() for r in (0, 1)]
    assert tokens[0] == tokens[1] and tokens[0].endswith(".1") and len(tokens[0]) == 18, tokens
    assert STORE_KEY.startswith("ckptd/")


def _part(step: int, node: int, attempt: str) -> fmt.PartManifest:
    return fmt.PartManifest(format=fmt.FORMAT_VERSION, step=step, node=node, num_nodes=2, world_size=2, ranks=[node],
                            arrays=[], objects={}, nbytes=0, written_at=0.0, attempt=attempt)


def test_notes_and_parts_of_another_attempt_are_not_this_ones(tmp_path: Path) -> None:
    async def go() -> None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            w = CheckpointWriter(backend)
            # a part of another attempt is missing, by name, until this attempt's arrives
            await w.write_part(_part(1, 0, "B.1"))
            await w.write_part(_part(1, 1, "A.1"))
            stale = r"node 1's part is from another attempt \(A\.1, this one is B\.1\)"
            with pytest.raises(SaveTimeoutError, match=stale):
                await w.wait_parts(1, 2, timeout=0.3, attempt="B.1")
            assert len(await w.wait_parts(1, 2, timeout=0.3)) == 2  # unnamed: any part, as before
            await w.write_part(_part(1, 1, "B.1"))
            assert [p.attempt for p in await w.wait_parts(1, 2, timeout=0.3, attempt="B.1")] == ["B.1", "B.1"]

            # a failure note of another attempt is ignored by a waiter; its own is not
            await w.mark_failed(2, StepFailedError("old"), attempt="A.1")
            with pytest.raises(SaveTimeoutError):
                await w.wait_committed(2, timeout=0.3, attempt="B.1", node=1)
            await w.mark_failed(2, StepFailedError("new"), attempt="B.1")
            with pytest.raises(StepFailedError, match="new"):
                await w.wait_committed(2, timeout=0.3, attempt="B.1", node=1)
            # a late note of the old attempt replaces the step's newest note, not the new attempt's own
            await w.mark_failed(2, StepFailedError("old, late"), attempt="A.1")
            with pytest.raises(StepFailedError, match="new"):
                await w.wait_committed(2, timeout=0.3, attempt="B.1", node=1)
            assert (await w.read_failed(2))["message"] == "old, late"  # what ls shows: the newest
            await backend.delete(fmt.failed_marker(2))  # the newest never written (its put failed)
            with pytest.raises(StepFailedError, match="new"):
                await w.wait_committed(2, timeout=0.3, attempt="B.1", node=1)
            await w.mark_failed(3, StepFailedError("ranks replaced"), attempt="B.1", superseded=True, node=1)
            await w.mark_failed(3, StepFailedError("late"), attempt="A.1", superseded=True, node=1)
            with pytest.raises(StepFailedError, match="node 1 gave it up"):
                await w.wait_parts(3, 2, timeout=5.0, attempt="B.1")
            await backend.delete_prefix(fmt.step_dir(3))

            # a node that gave this attempt up stops the coordinator; one that gave up another does not
            await w.write_part(_part(3, 0, "B.1"))
            await w.mark_failed(3, StepFailedError("ranks replaced"), attempt="A.1", superseded=True, node=1)
            with pytest.raises(SaveTimeoutError):
                await w.wait_parts(3, 2, timeout=0.3, attempt="B.1")
            await w.mark_failed(3, StepFailedError("ranks replaced"), attempt="B.1", superseded=True, node=1)
            with pytest.raises(StepFailedError, match="node 1 gave it up"):
                await w.wait_parts(3, 2, timeout=5.0, attempt="B.1")

            # a commit that holds another attempt's part of this node: this attempt's bytes are not in it
            await w.write_part(_part(4, 0, "A.1"))
            await w.write_part(_part(4, 1, "A.1"))
            manifest = await w.commit(4, 2, timeout=1.0, attempt="A.1")
            assert manifest.attempts == ["A.1", "A.1"]
            with pytest.raises(StepCommittedError, match=r"node 1's part of another attempt \(A\.1\)"):
                await w.wait_committed(4, timeout=1.0, attempt="B.1", node=1)
            assert (await w.wait_committed(4, timeout=1.0, attempt="A.1", node=1)).step == 4

    asyncio.run(go())


def test_a_node_that_failed_before_its_part_stops_the_coordinator_at_once(tmp_path: Path) -> None:
    """Another node's write failure used to be noted by node 0 only: the coordinator waited its whole
    timeout for the part and its ranks got a SaveTimeoutError instead of the cause. A node whose part was
    never sent now notes it (``part_missing``), for its attempt, or for an unnamed one after it began."""

    async def go() -> None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            w = CheckpointWriter(backend)
            await w.write_part(_part(5, 0, "B.1"))
            full = StepFailedError("disk full on node 1")
            await w.mark_failed(5, full, attempt="A.1", node=1, part_missing=True)  # another attempt's
            with pytest.raises(SaveTimeoutError):
                await w.wait_parts(5, 2, timeout=0.3, attempt="B.1", since=time.time() - 60)
            await w.mark_failed(5, full, attempt="B.1", node=1, part_missing=True)
            began = time.monotonic()
            with pytest.raises(StepFailedError, match="node 1 failed before its part was written: disk full"):
                await w.commit(5, 2, timeout=30.0, attempt="B.1")  # a named attempt needs no time
            assert time.monotonic() - began < 5
            await w.write_part(_part(6, 0, ""))  # unnamed: a note from before this attempt began is not its own
            await w.mark_failed(6, full, node=1, part_missing=True)
            with pytest.raises(SaveTimeoutError):
                await w.wait_parts(6, 2, timeout=0.3, since=time.time() + 60)
            with pytest.raises(StepFailedError, match="node 1 failed before its part was written"):
                await w.wait_parts(6, 2, timeout=30.0, since=time.time() - 60)

    asyncio.run(go())


def test_a_node_that_stops_waiting_and_the_coordinator_agree_on_the_outcome(tmp_path: Path) -> None:
    """At its commit timeout a node claims the attempt's verdict, create-once, before it reports the step
    failed; the coordinator claims it before its marker. Whoever comes first decides, so no node reports a
    step failed that then commits, nor waits in vain for one that cannot."""

    async def go() -> None:
        async with await open_backend(str(tmp_path / "root"), None, create=True) as backend:
            w = CheckpointWriter(backend)
            for node in (0, 1):
                await w.write_part(_part(1, node, "A.1"))
            # node 1 stops waiting first: the coordinator, its parts all there, must not commit
            with pytest.raises(SaveTimeoutError, match="this node stopped waiting first"):
                await w.wait_committed(1, timeout=0.2, attempt="A.1", node=1)
            with pytest.raises(SaveTimeoutError, match="node 1 stopped waiting for the commit"):
                await w.commit(1, 2, timeout=1.0, attempt="A.1")
            assert not await w.is_committed(1)
            with pytest.raises(SaveTimeoutError, match="node 1 stopped waiting first"):  # a third node, later
                await w.wait_committed(1, timeout=0.1, attempt="A.1", node=2)
            for node in (0, 1):  # the step saved again: a new attempt, decided anew
                await w.write_part(_part(1, node, "A.2"))
            assert (await w.commit(1, 2, timeout=1.0, attempt="A.2")).attempts == ["A.2", "A.2"]
            assert (await w.wait_committed(1, timeout=0.1, attempt="A.2", node=1)).step == 1

            # the coordinator decided first, its marker late: the node waits past its timeout for it. Ordered by
            # events, not by sleeps (the coordinator's metadata writes and filesystem sync before its claim, and
            # the node's polls, take longer than any fixed fraction of a second on a loaded runner): the node
            # starts waiting once the coordinator's verdict is there; the marker is written once the node, its
            # timeout over, has claimed the verdict and found the coordinator's
            for node in (0, 1):
                await w.write_part(_part(2, node, "B.1"))
            marker, claim = w.write_marker, w.claim_verdict
            node_claimed = asyncio.Event()

            async def watched_claim(step: int, attempt: str, verdict: str, *, node: int) -> dict[str, object] | None:
                standing = await claim(step, attempt, verdict, node=node)
                if verdict == "timeout":
                    node_claimed.set()
                return standing

            async def late_marker(step: int, data: bytes) -> None:
                await node_claimed.wait()
                await marker(step, data)

            w.claim_verdict = watched_claim  # type: ignore[method-assign]
            w.write_marker = late_marker  # type: ignore[method-assign]
            committing = asyncio.create_task(w.commit(2, 2, timeout=1.0, attempt="B.1"))
            deadline = time.monotonic() + 60
            while not await backend.exists(fmt.verdict_key(2, "B.1")):
                assert time.monotonic() < deadline, "the coordinator never claimed its verdict"
                await asyncio.sleep(0.01)
            started = time.monotonic()
            node_timeout = 2.0  # the marker comes after it; the node then waits up to as long again
            assert (await w.wait_committed(2, timeout=node_timeout, attempt="B.1", node=1)).step == 2
            assert node_claimed.is_set() and time.monotonic() - started >= node_timeout
            assert (await committing).attempts == ["B.1", "B.1"]

            # without attempt names nothing is claimed (the node's report may miss a late commit, as before)
            with pytest.raises(SaveTimeoutError, match=r"did not commit within 0s$"):
                await w.wait_committed(3, timeout=0.1, node=1)
            assert not await backend.list_dir(fmt.control_dir(fmt.step_dir(3)))

    asyncio.run(go())
