"""Operations against a live daemon: ``ckptd status`` (text, JSON, found by root), the opt-in Prometheus
endpoint, and ``ckptd plan`` wired to the sizing rule."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.protocol import PROTOCOL_VERSION, LeaseGranted, LeaseRequest, ReleaseRequest
from ckptd.daemon.cli import main
from ckptd.daemon.sizing import plan_arena
from ckptd.testing.launch import DaemonProcess

pytestmark = pytest.mark.timeout(120)
CLI = [sys.executable, "-m", "ckptd.daemon.cli"]


def ckptd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics:\n{text}")


def _metrics_url(d: DaemonProcess) -> str:
    """Where a daemon started with ``--metrics-port 0`` serves its metrics, as ``ckptd status`` says (a port
    picked free by the test could be taken before the daemon binds it)."""
    out = ckptd("status", "--socket", d.socket, "--json")
    assert out.returncode == 0, out.stderr
    url = str(json.loads(out.stdout)["metrics_url"])
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url) and not url.endswith(":0/metrics"), url
    return url


def test_status_and_metrics_of_a_live_daemon(start_daemon, tmp_path, sockdir):
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0", "--part-timeout", "8", "--metrics-port", "0", arena="32MiB")
    url = _metrics_url(d)
    assert d.log_path is not None and f"metrics on {url}" in Path(d.log_path).read_text()  # the log says it too
    clients = [CheckpointClient(d.socket, placement=Placement(r, 2, 2, 0)) for r in range(2)]
    n = 1 << 18  # 1 MiB of float32 per rank

    def state(r: int) -> dict[str, Shard]:
        return {"x": Shard("x", torch.full((n,), float(r)), (2 * n,), (r * n,))}

    for h in [c.save(1, state(r)) for r, c in enumerate(clients)]:
        h.wait(30)
    pending = clients[0].save(2, state(0))  # rank 1 never saves step 2

    out = ckptd("status", "--socket", d.socket, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["daemon_pid"] == d.pid and report["root"] == root and report["arena_bytes"] == 32 << 20
    # an operator's daemon: no job id, no owner; the socket is the one it listens on
    assert (report["job_id"], report["owner_pid"], report["socket"], report["draining"]) == ("", 0, d.socket, False)
    assert report["in_flight"] == 1 and report["commits"] == 1 and report["failures"] == 0
    assert report["bytes_written"] == 2 * (1 << 20)
    steps = {s["step"]: s for s in report["steps"]}
    assert steps[2]["state"] == "pending" and (steps[2]["ranks_saved"], steps[2]["local_world_size"]) == (1, 2)
    assert steps[1]["state"] == "committed"

    # found by root among this user's sockets (the default socket's folder, here the test's)
    env = {"CKPTD_SOCKET": os.path.join(sockdir, "default.sock")}
    by_root = ckptd("status", "--root", root, env=env)
    assert by_root.returncode == 0, by_root.stderr
    assert "1 in flight, 1 committed, 0 failed" in by_root.stdout and "pending" in by_root.stdout
    assert f"metrics  {url}" in by_root.stdout

    deadline = time.monotonic() + 30  # the part timeout abandons step 2: a failure with its reason
    while not pending.done() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pending.exception() is not None
    report = json.loads(ckptd("status", "--socket", d.socket, "--json").stdout)
    assert report["in_flight"] == 0 and report["failures"] == 1 and "never saved" in report["last_error"]
    # the abandoned step's staging space is back; what is still used is step 1, kept for an in-memory restore,
    # and the space each rank's last save asked for its next one
    assert report["arena_ahead_bytes"] > 0
    assert (report["arena_free_bytes"] + report["arena_retained_bytes"] + report["arena_ahead_bytes"]
            == report["arena_bytes"])
    assert report["arena_retained_bytes"] > 0

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert _metric(text, "ckptd_steps_committed_total") == 1.0
    assert _metric(text, "ckptd_steps_failed_total") == 1.0
    assert _metric(text, "ckptd_bytes_written_total") == 2 * (1 << 20)
    assert _metric(text, "ckptd_save_stall_seconds_count") == 3.0  # two saves of step 1, one of step 2
    assert 0 < _metric(text, "ckptd_save_stall_seconds_sum") < 30
    assert _metric(text, "ckptd_step_drain_seconds_count") == 1.0
    assert _metric(text, "ckptd_arena_bytes") == 32 << 20
    assert _metric(text, "ckptd_arena_used_bytes") == report["arena_bytes"] - report["arena_free_bytes"]
    assert _metric(text, "ckptd_arena_ahead_bytes") == report["arena_ahead_bytes"]
    assert _metric(text, "ckptd_storage_retries_total") == 0
    for c in clients:
        c.close()


def test_status_names_the_job_owner_socket_and_drain(start_daemon, tmp_path, capsys):
    """A daemon bound to a job (``--job-id``, ``--owner-pid``, as the embedded mode starts it): status names
    its job, owner, socket and root, and shows it draining once the owner is gone, until it exits."""
    root = str(tmp_path / "ckpt")
    owner = subprocess.Popen(["sleep", "600"])
    try:
        d = start_daemon(root, "d0", "--job-id", "slurm:77", "--owner-pid", str(owner.pid), "--part-timeout", "5",
                         "--drain-grace", "60", arena="8MiB")
        report = json.loads(ckptd("status", "--socket", d.socket, "--json").stdout)
        assert (report["job_id"], report["owner_pid"], report["socket"], report["root"], report["draining"],
                report["daemon_pid"]) == ("slurm:77", owner.pid, d.socket, root, False, d.pid)
        text = ckptd("status", "--socket", d.socket).stdout
        assert f"daemon   pid {d.pid}  socket {d.socket}  up " in text, text
        assert f"job      slurm:77  owner pid {owner.pid}\nstate    serving\nroot     {root}\n" in text, text

        client = CheckpointClient(d.socket, placement=Placement(0, 2, 2, 0), job_id="slurm:77")
        pending = client.save(1, {"x": Shard("x", torch.ones(1024), (2048,), (0,))})  # rank 1 never saves
        owner.kill()  # the job is over: the daemon drains its step in flight (until the part timeout), then exits
        owner.wait()
        deadline = time.monotonic() + 30
        while True:
            assert main(["status", "--socket", d.socket]) == 0
            text = capsys.readouterr().out
            if "DRAINING" in text or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "state    DRAINING: takes no new saves" in text and "1 in flight" in text, text
        assert d.proc.wait(60) == 0  # the step failed (part timeout): nothing left to drain
        assert pending.exception() is not None and not os.path.exists(d.socket)
        client.close()
    finally:
        owner.kill()
        owner.wait()


def test_status_without_flags_finds_the_users_one_daemon(tmp_path, sockdir):
    """``ckptd status`` with no flags and no CKPTD_SOCKET/CKPTD_ROOT asks the node's one daemon of this user
    (a daemon started with ``--root`` alone listens on its root's socket, not on a fixed path)."""
    from ckptd.client.paths import default_socket_path

    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_SOCKET", "CKPTD_ROOT")}
    env["XDG_RUNTIME_DIR"] = sockdir
    root = str(tmp_path / "ckpt")
    d = DaemonProcess(root, default_socket_path(env, root), "--arena-size", "16MiB", env=env).wait_ready()
    try:
        out = subprocess.run([*CLI, "status", "--json"], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["socket"] == d.socket
    finally:
        d.stop(30)


def test_status_without_a_daemon_is_a_clear_error(sockdir):
    out = ckptd("status", "--socket", os.path.join(sockdir, "nobody.sock"))
    assert out.returncode == 2 and "DaemonUnavailableError" in out.stderr


def test_plan_matches_the_sizing_rule():
    out = ckptd("plan", "--params", "70B", "--tp", "8", "--pp", "4", "--dp", "4", "--ranks-per-node", "8", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == plan_arena(70 * 10**9, tp=8, pp=4, dp=4, ranks_per_node=8).to_dict()
    text = ckptd("plan", "--params", "7e9", "--weight-dtype", "fp32", "--ranks-per-node", "1")
    assert "16 B/param" in text.stdout and "--arena-size" in text.stdout
    bad = ckptd("plan", "--params", "lots")
    assert bad.returncode == 2 and "ConfigError" in bad.stderr


def test_status_counts_the_saves_waiting_for_staging_space(start_daemon, tmp_path):
    """A lease request that waits for space shows in ``ckptd status`` (JSON, text, metric) while it waits,
    and no longer once the space it waited for is given back and granted."""
    d = start_daemon(str(tmp_path / "ckpt"), "d0", "--metrics-port", "0", arena="8MiB")
    url = _metrics_url(d)
    holder, waiter = (CheckpointClient(d.socket, placement=Placement(r, 2, 2, 0)) for r in (0, 1))
    held = holder._request(LeaseRequest(v=PROTOCOL_VERSION, step=1, rank=0, sizes=[6 << 20], timeout_s=0))
    assert isinstance(held, LeaseGranted)
    answers: list[object] = []
    asking = threading.Thread(target=lambda: answers.append(
        waiter._request(LeaseRequest(v=PROTOCOL_VERSION, step=1, rank=1, sizes=[4 << 20], timeout_s=60))))
    asking.start()
    deadline = time.monotonic() + 30
    while (report := json.loads(ckptd("status", "--socket", d.socket, "--json").stdout))["arena_waiting"] != 1:
        assert time.monotonic() < deadline, report
        time.sleep(0.1)
    assert "; 1 save(s) waiting for staging space" in ckptd("status", "--socket", d.socket).stdout
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert _metric(text, "ckptd_arena_waiting") == 1
    holder._request(ReleaseRequest(v=PROTOCOL_VERSION, lease_id=held.lease_id))
    asking.join(30)
    assert [type(a) for a in answers] == [LeaseGranted]
    report = json.loads(ckptd("status", "--socket", d.socket, "--json").stdout)
    assert report["arena_waiting"] == 0 and report["leases"] == 1
    assert "waiting for staging space" not in ckptd("status", "--socket", d.socket).stdout
    for c in (holder, waiter):
        c.close()


def test_a_save_waits_for_staging_space_up_to_lease_timeout_not_the_request_timeout(start_daemon, tmp_path):
    """``backpressure="wait"``: a save waits for arena space up to ``lease_timeout_s``, past ``timeout_s``
    (the bound on the daemon's ordinary answers), and goes through once the space is given back."""
    d = start_daemon(str(tmp_path / "ckpt"), "d0", "--part-timeout", "1", arena="8MiB")  # rank 0 never saves
    holder = CheckpointClient(d.socket, placement=Placement(0, 2, 2, 0))
    waiter = CheckpointClient(d.socket, placement=Placement(1, 2, 2, 0), timeout_s=1, lease_timeout_s=30)
    held = holder._request(LeaseRequest(v=PROTOCOL_VERSION, step=1, rank=0, sizes=[6 << 20], timeout_s=0))
    assert isinstance(held, LeaseGranted)
    give_back = threading.Timer(2.5, lambda: holder._request(ReleaseRequest(v=PROTOCOL_VERSION,
                                                                            lease_id=held.lease_id)))
    give_back.start()
    t0 = time.monotonic()
    n = 1 << 20  # 4 MiB of float32: fits only once the holder's 6 MiB are back
    handle = waiter.save(1, {"x": Shard("x", torch.ones(n), (2 * n,), (n,))})
    waited = time.monotonic() - t0
    give_back.join()
    assert waited > 2 and not handle.skipped and handle.nbytes == 4 * n
    for c in (holder, waiter):
        c.close()


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path) -> None:
    """``ckptd ls ROOT | head``: stdout's reader is gone before the command writes; it ends quietly (141,
    as a shell reports SIGPIPE), with nothing on stderr but the note that the root holds no steps."""
    proc = subprocess.Popen([*CLI, "ls", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == f"ckptd ls: no steps under {tmp_path}\n".encode(), err


def test_status_waits_for_a_daemon_still_starting(tmp_path, sockdir):
    """``ckptd status --wait S``: what a job script runs between ``ckptd serve &`` and its ranks. A daemon fills
    its arena before it listens, so a rank started at once would find no socket; the wait ends when it answers,
    and without a daemon it fails once the wait is over."""
    socket = os.path.join(sockdir, "late.sock")
    t0 = time.monotonic()
    missing = ckptd("status", "--socket", socket, "--wait", "1")
    assert missing.returncode != 0 and "late.sock" in missing.stderr, missing
    assert 1.0 <= time.monotonic() - t0 < 30
    waiting = subprocess.Popen([*CLI, "status", "--socket", socket, "--wait", "60", "--json"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)  # the status is asking meanwhile
    assert waiting.poll() is None
    d = DaemonProcess(str(tmp_path / "ckpt"), socket, "--arena-size", "16MiB").wait_ready()
    try:
        out, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, err
        assert json.loads(out)["daemon_pid"] == d.pid
    finally:
        d.stop(30)
