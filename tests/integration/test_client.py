"""Client behaviour against a real daemon: backpressure policies, background errors, the embedded daemon."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from ckptd.client import (
    BackpressureError,
    CheckpointClient,
    DaemonUnavailableError,
    Placement,
    SaveTimeoutError,
    StepFailedError,
)
from ckptd.client.protocol import PROTOCOL_VERSION, LeaseGranted, LeaseRequest
from ckptd.client.reader import load
from ckptd.testing.wire import RawPeer
from ckptd.writer.errors import ArenaError

MB6 = (6 << 20) // 4  # float32 elements in 6 MiB


def _hold(socket_path: str, nbytes: int) -> CheckpointClient:
    """A client that takes staging space and sits on it (the arena stays full until it closes)."""
    holder = CheckpointClient(socket_path, placement=Placement(0, 1, 1, 0))
    reply = holder._request(LeaseRequest(v=PROTOCOL_VERSION, step=99, rank=0, sizes=[nbytes], timeout_s=1))
    assert isinstance(reply, LeaseGranted)
    return holder


def test_backpressure_policies(start_daemon, tmp_path):
    d = start_daemon(str(tmp_path / "ckpt"), "d0", arena="8MiB")
    one = Placement(0, 1, 1, 0)
    holder = _hold(d.socket, 6 << 20)
    with pytest.raises(BackpressureError):
        CheckpointClient(d.socket, placement=one, backpressure="fail").save(2, {"x": torch.randn(MB6)})
    skipped = CheckpointClient(d.socket, placement=one, backpressure="skip").save(2, {"x": torch.randn(MB6)})
    assert skipped.skipped and skipped.done() and skipped.nbytes == 0
    with pytest.raises(ArenaError):  # never fits, whatever the policy
        CheckpointClient(d.socket, placement=one).save(3, {"x": torch.randn(3 * MB6)})
    with pytest.raises(SaveTimeoutError):
        t0 = time.monotonic()
        CheckpointClient(d.socket, placement=one, lease_timeout_s=0.2).save(2, {"x": torch.randn(MB6)})
    assert time.monotonic() - t0 < 60  # its 0.2 s, not the default lease_timeout_s (300 s)
    waiting = CheckpointClient(d.socket, placement=one, backpressure="wait", lease_timeout_s=60)
    data = torch.randn(MB6)
    t0 = time.monotonic()  # before the timer starts: the save cannot have the space back sooner than 0.5 s after
    threading.Timer(0.5, holder.close).start()  # the space comes back when the holder goes away
    waiting.save(2, {"x": data}).wait(60)
    assert time.monotonic() - t0 >= 0.4
    out = torch.zeros(MB6)
    load(d.root, 2, {"x": out})
    assert torch.equal(out, data)


def test_background_failure_reaches_next_save_and_wait(start_daemon, tmp_path):
    d = start_daemon(str(tmp_path / "ckpt"), "d0", "--part-timeout", "1")
    lonely = CheckpointClient(d.socket, placement=Placement(0, 2, 2, 0))  # its partner rank never saves
    handle = lonely.save(1, {"x": torch.zeros(4)})
    # once the daemon failed step 1 (--part-timeout; asked on a connection of its own, which delivers nothing
    # to the client): a fixed sleep assumed the timer had fired by then, which a loaded runner need not keep
    assert RawPeer(d.socket).final_status(1).state == "failed"
    with pytest.raises(StepFailedError) as err:
        lonely.save(2, {"x": torch.zeros(4)})
    assert "never saved" in str(err.value)
    with pytest.raises(SaveTimeoutError):  # the typed cause on wait()
        handle.wait(10)


def test_embedded_daemon_started_once_for_all_local_ranks(tmp_path, sockdir):
    root = str(tmp_path / "ckpt")
    sock = os.path.join(sockdir, "embedded.sock")
    clients: list[CheckpointClient] = []
    errors: list[BaseException] = []

    def connect(rank: int) -> None:
        try:
            clients.append(CheckpointClient(sock, root=root, start_daemon=True, placement=Placement(rank, 2, 2, 0),
                                            daemon_args=["--arena-size", "32MiB", "--no-prefault"]))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    pids = {c._welcome.daemon_pid for c in clients}  # type: ignore[union-attr]
    assert len(pids) == 1 and pids.pop() != os.getpid()
    try:
        saved = {r: torch.arange(4, dtype=torch.float32) + 10 * (r + 1) for r in range(2)}
        handles = [c.save(5, {"x": saved[c.placement.rank].clone(), "r": c.placement.rank}) for c in clients]
        for h in handles:
            h.wait(30)
        out = torch.full((4,), -1.0)
        assert load(root, "latest", {"x": out})["x"] is out
        assert torch.equal(out, saved[0]), out  # a replicated tensor: rank 0's copy is the one written
    finally:
        pid = clients[0]._welcome.daemon_pid  # type: ignore[union-attr]
        for c in clients:
            c.close()
        os.kill(pid, signal.SIGTERM)


def test_no_daemon_is_a_typed_error(sockdir):
    with pytest.raises(DaemonUnavailableError):
        CheckpointClient(os.path.join(sockdir, "nobody.sock"), placement=Placement(0, 1, 1, 0), timeout_s=2)


@pytest.mark.gpu
def test_cuda_tensors_staged_with_one_d2h_copy(start_daemon, tmp_path):
    assert torch.cuda.is_available()
    d = start_daemon(str(tmp_path / "ckpt"), arena="256MiB")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    x = torch.randn(8 << 20, device="cuda")
    y = torch.randn(1024, device="cuda").bfloat16()
    handle = client.save(1, {"x": x, "y": y})
    x.zero_()  # a true snapshot: overwritten right after save() returned
    handle.wait(60)
    assert client._staging.pinned
    out_x, out_y = torch.zeros(8 << 20), torch.zeros(1024, dtype=torch.bfloat16)
    load(d.root, 1, {"x": out_x, "y": out_y})
    torch.manual_seed(0)
    assert torch.equal(out_y, y.cpu()) and not torch.equal(out_x, x.cpu())
