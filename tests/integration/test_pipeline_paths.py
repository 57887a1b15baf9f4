"""``assume_constant_structure`` saves that wait for no answer (:mod:`ckptd.client.pipeline`): the paths where
the answer read later is not a plain acceptance.

- A step that fails in the daemon after it accepted the save (the disk fills: a real size-limited tmpfs)
  reaches the caller exactly once, as in the checked mode: by the handle's ``wait()`` or, unwaited, by one
  later ``save()`` (learned through the status requests sent with a later save); the saves after it commit.
- The daemon restarts between saves (a new process on the same socket): it knows none of the plans. Each
  rank's save registers its plan again and commits bit-exact, also when the first rank to register on the
  new daemon gets the id another rank's plan had on the old one (the daemon refuses a plan of another rank:
  before, that save was expanded with the other rank's layout and the step failed on overlapping shards).
- The daemon dies before it reads a save: lost under ``on_daemon_lost`` ("warn": one warning per save;
  "raise"), delivered once, and the saves on a restarted daemon commit.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_disk_full import _tmpfs, fill
from test_plain_reuse import _bits, _state

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.protocol import StepState
from ckptd.client.reader import load
from ckptd.writer.errors import DaemonUnavailableError, StepFailedError, StorageFullError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with _tmpfs(tmp_path / "small", "4m") as mnt:
        yield mnt


def _check(root: str, step: int, state: dict[str, torch.Tensor]) -> None:
    out = {k: torch.full_like(v, 7) for k, v in state.items()}
    load(root, step, out)
    for k, v in state.items():
        assert torch.equal(_bits(out[k]), _bits(v)), (step, k)


def _failed(client: CheckpointClient, step: int) -> None:
    """Wait until the daemon reports ``step`` failed (asked on another connection: delivers nothing). Under
    the promise the save may not be read yet (``UNKNOWN``): it was sent, not answered."""
    deadline = time.monotonic() + 30
    while (st := client._status(step, 1.0)).state is not StepState.FAILED:
        assert st.state in (StepState.PENDING, StepState.UNKNOWN) and time.monotonic() < deadline, st
        time.sleep(0.01)
    assert st.error_code == "StorageFullError", st


@pytest.mark.parametrize("waited", [True, False], ids=["wait", "unwaited"])
@pytest.mark.parametrize("constant", [False, True], ids=["checked", "pipelined"])
def test_background_storage_failure_is_delivered_once(small_fs, start_daemon, constant, waited):
    root = str(small_fs / "ckpt")
    d = start_daemon(root, "d0", arena="16MiB")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), assume_constant_structure=constant)
    probe = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    for step in (1, 2):  # the second save of a structure plans (and, under the promise, pipelines)
        client.save(step, _state(step)).wait(60)
    filler = fill(small_fs, leave=0)
    failing = client.save(3, _state(3))  # accepted, then its write hits ENOSPC in the daemon
    _failed(probe, 3)
    filler.unlink()
    raised: list[int] = []
    if waited:
        with pytest.raises(StorageFullError):
            failing.wait(60)
    handles = {}
    for step in range(4, 8):  # under the promise the failure arrives with the answers to a later save
        state = _state(step)
        try:
            handles[step] = (client.save(step, state), state)
        except StepFailedError as exc:
            assert isinstance(exc.__cause__, StorageFullError), exc
            raised.append(step)
    assert raised == ([] if waited else [4 if not constant else 5]), raised
    assert failing.state is StepState.FAILED and isinstance(failing.exception(), StorageFullError)
    for step, (handle, state) in handles.items():
        handle.wait(60)
        _check(root, step, state)
    assert client._raise_background_errors() is None  # nothing left to deliver
    client.close()
    probe.close()


@pytest.mark.parametrize("constant", [False, True], ids=["checked", "pipelined"])
def test_restarted_daemon_gets_each_plan_again_and_saves_commit_bit_exact(start_daemon, tmp_path, constant):
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0")
    clients = [CheckpointClient(d.socket, placement=Placement(r, 2, 2, 0), assume_constant_structure=constant)
               for r in range(2)]

    def state(rank: int, step: int) -> dict[str, Shard]:  # each rank's own row of every key
        return {k: Shard.per_rank(k, v, rank, 2) for k, v in _state(10 * step + rank).items()}

    def check(step: int) -> None:
        for rank in range(2):
            saved = _state(10 * step + rank)
            out = {k: torch.full_like(v, 7) for k, v in saved.items()}
            load(root, step, {k: Shard.per_rank(k, v, rank, 2) for k, v in out.items()})
            for k, v in saved.items():
                assert torch.equal(_bits(out[k]), _bits(v)), (step, rank, k)

    for step in (1, 2):  # step 2 registers rank 0's plan (id 1 on this daemon), then rank 1's (id 2)
        for h in [c.save(step, state(r, step)) for r, c in enumerate(clients)]:
            h.wait(60)
    d.stop(timeout=20)
    d = start_daemon(root, "d0")  # the same socket: a daemon without plans
    # rank 1 saves first: its plan is registered again (id 1 on this daemon, rank 0's id on the old one)
    handles = {}
    for r in (1, 0):
        handles[r] = clients[r].save(3, state(r, 3))
        if r == 1:
            handles[r].durable()  # reads the pipelined answer: the resend happens here
    for r in (0, 1):  # rank 0's refusal is read at its next exchange (this wait): the step commits after it
        handles[r].wait(60)
    check(3)
    # both saves named a plan id the new daemon does not hold for their rank, and were sent again
    log = (tmp_path / "d0.log").read_text()
    assert log.count("PlanUnknownError") == 2 and "registered by rank 1, not 0" in log, log
    for h in [c.save(4, state(r, 4)) for r, c in enumerate(clients)]:  # and the plans are kept from here on
        h.wait(60)
    check(4)
    for c in clients:
        c.close()


@pytest.mark.parametrize("waited", [True, False], ids=["wait", "unwaited"])
@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_daemon_lost_before_reading_a_pipelined_save(start_daemon, tmp_path, caplog, policy, waited):
    """The daemon dies (stopped, then killed) before it reads a save that waited for no answer: the save is
    lost under ``on_daemon_lost`` as in the checked mode (one warning, or a raise), delivered once — by
    ``wait()`` or, unwaited, by a save after a daemon is back (the status asked with the save before it) —
    and the saves on the restarted daemon commit bit-exact."""
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), assume_constant_structure=True,
                              on_daemon_lost=policy, timeout_s=30)
    for step in (1, 2):
        client.save(step, _state(step)).wait(60)
    os.kill(d.proc.pid, signal.SIGSTOP)  # reads nothing from here on
    lost = client.save(3, _state(3))  # sent, not answered: returns at once
    d.kill()
    outcomes: dict[int, str] = {}
    handles = {}
    with caplog.at_level(logging.WARNING, logger="ckptd.client.client"):
        if waited:
            if policy == "raise":
                with pytest.raises(DaemonUnavailableError):
                    lost.wait(60)
            else:
                assert lost.wait(60) is lost
        for step in range(4, 8):
            if step == 5:
                start_daemon(root, "d0")  # an operator restarts it
            state = _state(step)
            try:
                handles[step] = (client.save(step, state), state)
                outcomes[step] = handles[step][0].state.value
            except DaemonUnavailableError:
                outcomes[step] = "raised lost"
            except StepFailedError as exc:
                assert isinstance(exc.__cause__, DaemonUnavailableError), exc
                outcomes[step] = "raised earlier"
    assert lost.state is StepState.FAILED and isinstance(lost.exception(), DaemonUnavailableError)
    step4 = "raised lost" if policy == "raise" else "failed"  # no daemon at all
    late = {} if waited else {6: "raised earlier" if policy == "raise" else "pending"}
    assert outcomes == {4: step4, 5: "pending", 6: "pending", 7: "pending", **late}, outcomes
    warned = sorted(int(m.split("step ")[1].split()[0]) for m in
                    (r.getMessage() for r in caplog.records) if "training goes on" in m)
    assert warned == ([] if policy == "raise" else [3, 4]), warned  # once each
    for step, (handle, state) in handles.items():
        if step > 4:
            handle.wait(60)
            _check(root, step, state)
    client.close()
