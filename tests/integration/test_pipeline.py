"""End to end with real processes: gloo ranks -> shared memory -> daemon subprocesses -> zarr v3 -> load."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from ckptd.client import CheckpointClient, CheckpointNotFoundError, DaemonUnavailableError, Placement, Shard
from ckptd.testing.launch import run_ranks
from ckptd.writer.errors import CkptdError, SaveTimeoutError
from ckptd.writer.format import decode_commit, decode_part, part_key

# --- the state each rank saves: deterministic, so any process can rebuild what was saved ---------


def expected_state(rank: int, world: int, step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(1000 * step + 7)
    w = torch.randn(4 * world, 6, generator=g)  # split by rows: a TP-like shard per rank
    emb = torch.randn(2 * world, 5, generator=g).to(torch.bfloat16)
    bias = torch.randn(7, generator=g)  # replicated: identical on every rank, written once
    counts = torch.arange(3, dtype=torch.int64) + 100 * rank + step  # differs per rank
    return {
        "model": {
            "w": Shard("model/w", w[4 * rank : 4 * rank + 4].clone(), tuple(w.shape), (4 * rank, 0)),
            "emb": Shard("model/emb", emb[2 * rank : 2 * rank + 2].clone(), tuple(emb.shape), (2 * rank, 0)),
            "bias": Shard("model/bias", bias.clone(), (7,), (0,), replica_id=rank),
        },
        "counts": Shard.per_rank("counts", counts, rank, world),
        "replicated": torch.full((3, 3), float(step)),
        "meta": {"step": step, "note": f"rank{rank}", "lrs": [0.1, 0.01]},
    }


def zero_template(rank: int, world: int) -> dict[str, object]:
    ref = expected_state(rank, world, 0)

    def zero(leaf: object) -> object:
        if isinstance(leaf, Shard):
            return Shard(leaf.key, torch.zeros_like(leaf.data.squeeze(0) if leaf.key == "counts" else leaf.data),
                         leaf.global_shape, leaf.global_offset, leaf.replica_id) if leaf.key != "counts" else \
                Shard.per_rank("counts", torch.zeros_like(leaf.data.squeeze(0)), rank, world)
        if isinstance(leaf, torch.Tensor):
            return torch.zeros_like(leaf)
        if isinstance(leaf, dict):
            return {k: zero(v) for k, v in leaf.items()}
        return None

    return {k: zero(v) for k, v in ref.items()}


def tensors(state: dict[str, object], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, Shard):
            out[prefix + k] = v.data
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
        elif isinstance(v, dict):
            out.update(tensors(v, f"{prefix}{k}/"))
    return out


def client_for(sockets: list[str], rank: int, world: int, local: int) -> CheckpointClient:
    return CheckpointClient(sockets[rank // local], placement=Placement(rank, world, local, rank // local))


# --- rank bodies (module level: they run in forked rank processes) -------------------------------


def rank_save(rank: int, world: int, sockets: list[str], local: int, steps: list[int]) -> list[float]:
    client = client_for(sockets, rank, world, local)
    stalls = []
    for step in steps:
        handle = client.save(step, expected_state(rank, world, step))
        stalls.append(handle.stall_s)
        torch.distributed.barrier()
        handle.wait(timeout=60)
    return stalls


def rank_load_check(rank: int, world: int, root: str, step: object, expect_step: int) -> bool:
    template = zero_template(rank, world)
    from ckptd.client.reader import load

    out = load(root, step, template, rank=rank)  # type: ignore[arg-type]
    want = tensors(expected_state(rank, world, expect_step))
    got = tensors(template)
    assert want.keys() == got.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), f"{key} differs (rank {rank})"
    assert out["meta"] == {"step": expect_step, "note": f"rank{rank}", "lrs": [0.1, 0.01]}
    return True


def rank_overwrite_after_save(rank: int, world: int, sockets: list[str]) -> bool:
    client = client_for(sockets, rank, world, world)
    state = expected_state(rank, world, 3)
    handle = client.save(3, state)
    for t in tensors(state).values():  # the trainer moves on and overwrites its tensors at once
        t.fill_(-7)
    handle.wait(timeout=60)
    return True


def rank_dies_after_save(rank: int, world: int, sockets: list[str]) -> bool:
    client = client_for(sockets, rank, world, world)
    handle = client.save(5, expected_state(rank, world, 5))
    if rank == 1:
        os._exit(0)  # killed right after save() returned: no wait, no cleanup
    handle.wait(timeout=60)
    return True


# --- tests ---------------------------------------------------------------------------------------


def test_two_nodes_four_ranks_round_trip_bit_exact(start_daemon, tmp_path):
    root = str(tmp_path / "ckpt")
    d0 = start_daemon(root, "node0")
    d1 = start_daemon(root, "node1")
    run_ranks(rank_save, 4, [d0.socket, d1.socket], 2, [10, 20], local_world_size=2)
    assert run_ranks(rank_load_check, 4, root, "latest", 20) == [True] * 4
    assert run_ranks(rank_load_check, 4, root, 10, 10) == [True] * 4

    # Replicated tensors were written once (rank 0), sharded ones once per owner, by the right node.
    commit = decode_commit((tmp_path / "ckpt" / "step_20" / "_ckptd" / "COMMITTED").read_bytes())
    writers = {a.name: sorted(s.rank for s in a.shards) for a in commit.arrays}
    assert writers == {"model/w": [0, 1, 2, 3], "model/emb": [0, 1, 2, 3], "model/bias": [0],
                       "counts": [0, 1, 2, 3], "replicated": [0]}
    part1 = decode_part((tmp_path / "ckpt" / "step_20" / "_ckptd" / "_parts" / "node-1.json").read_bytes())
    assert part1.ranks == [2, 3] and {s.rank for a in part1.arrays for s in a.shards} == {2, 3}
    assert (tmp_path / "ckpt" / "_ckptd" / "latest").read_text() == "20"

    # Any zarr v3 reader gets the bytes without ckptd: bf16 is raw uint16 bits plus a dtype attribute.
    emb = zarr.open_array(store=str(tmp_path / "ckpt"), path="step_20/model/emb", mode="r")
    assert emb.attrs["ckptd"]["torch_dtype"] == "bfloat16" and emb.dtype == np.uint16
    full = torch.cat([expected_state(r, 4, 20)["model"]["emb"].data for r in range(4)])  # type: ignore[index]
    assert np.array_equal(emb[:], full.view(torch.int16).numpy().view(np.uint16))

    out = subprocess.run([sys.executable, "-m", "ckptd.daemon.cli", "verify", root, "--json"],
                         capture_output=True, text=True, check=True)
    assert [r["ok"] for r in json.loads(out.stdout)] == [True, True]
    assert "step=20 node=0 state=committed" in Path(d0.log_path).read_text()  # type: ignore[arg-type]


def test_snapshot_semantics_tensors_overwritten_after_save(start_daemon, tmp_path):
    root = str(tmp_path / "ckpt")
    d0 = start_daemon(root)
    run_ranks(rank_overwrite_after_save, 2, [d0.socket])
    assert run_ranks(rank_load_check, 2, root, 3, 3) == [True, True]


def test_rank_killed_after_save_still_commits(start_daemon, tmp_path):
    root = str(tmp_path / "ckpt")
    d0 = start_daemon(root)
    run_ranks(rank_dies_after_save, 2, [d0.socket], may_exit=[1])
    assert run_ranks(rank_load_check, 2, root, 5, 5) == [True, True]


def test_daemon_kill_9_mid_save(start_daemon, tmp_path):
    root = str(tmp_path / "ckpt")
    slow = ("--chunk-bytes", "128KiB", "--write-concurrency", "1")
    d0 = start_daemon(root, "d0", *slow, arena="256MiB")
    client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0), timeout_s=5, on_daemon_lost="raise")
    small = {"x": torch.arange(10.0)}
    client.save(1, small).wait(30)

    big = {"x": torch.arange(10.0), "big": torch.randn(48 << 18)}  # 48 MiB in ~400 chunks
    handle = client.save(2, big)
    time.sleep(0.1)  # let it write some chunks: the kill lands mid-write
    os.kill(d0.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailableError):
        handle.wait(timeout=10)
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "ckpt" / "step_2" / "_ckptd" / "COMMITTED").exists()

    from ckptd.client.reader import load

    template = {"x": torch.zeros(10)}
    load(root, "latest", template)
    assert torch.equal(template["x"], small["x"])
    with pytest.raises(CheckpointNotFoundError):  # UncommittedStepError once any chunk landed
        load(root, 2, {"x": torch.zeros(10)})

    # A restarted daemon serves again; the partial step is re-written cleanly (stale part discarded).
    d0b = start_daemon(root, "d0", *slow, arena="256MiB")
    client = CheckpointClient(d0b.socket, placement=Placement(0, 1, 1, 0))
    big2 = {"x": torch.arange(10.0) + 1, "big": torch.randn(48 << 18)}
    client.save(2, big2).wait(60)
    template2 = {"x": torch.zeros(10), "big": torch.zeros(48 << 18)}
    load(root, "latest", template2)
    assert torch.equal(template2["big"], big2["big"]) and torch.equal(template2["x"], big2["x"])
    client.close()


def test_sigterm_drains_in_flight_save(start_daemon, tmp_path):
    root = str(tmp_path / "ckpt")
    d0 = start_daemon(root, "d0", "--chunk-bytes", "256KiB", "--write-concurrency", "1", arena="128MiB")
    client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0))
    state = {"big": torch.randn(24 << 18)}
    saved = state["big"].clone()
    client.save(7, state)
    d0.proc.send_signal(signal.SIGTERM)
    assert d0.proc.wait(60) == 0
    assert (tmp_path / "ckpt" / "step_7" / "_ckptd" / "COMMITTED").exists()
    log = Path(d0.log_path).read_text()  # type: ignore[arg-type]
    assert "draining 1 in-flight step" in log and "step=7 node=0 state=committed" in log
    client.close()

    # what the drain wrote is what was saved, bit for bit (not whatever the arena held during shutdown)
    from ckptd.client.reader import load

    template = {"big": torch.full_like(saved, float("nan"))}
    load(root, 7, template)
    assert torch.equal(template["big"].view(torch.int32), saved.view(torch.int32)), "step 7 differs from the save"


def test_retention_keeps_newest_and_gc_cli(start_daemon, tmp_path):
    root = str(tmp_path / "ckpt")
    d0 = start_daemon(root, "d0", "--keep", "2")
    client = CheckpointClient(d0.socket, placement=Placement(0, 1, 1, 0))
    for step in (1, 2, 3, 4):
        client.save(step, {"x": torch.full((4,), float(step))}).wait(30)
    steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    assert steps == ["step_3", "step_4"]
    cli = [sys.executable, "-m", "ckptd.daemon.cli"]
    subprocess.run([*cli, "gc", root, "--keep", "1"], check=True, capture_output=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_4"]
    # An unfinished step older than the newest commit, written to just now: a daemon may still be writing it
    # (steps can commit out of order), so gc leaves it until nothing was written under it for --grace.
    chunk = tmp_path / "ckpt" / "step_3" / "x" / "c.0"
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(b"\0" * 16)
    out = subprocess.run([*cli, "gc", root, "--keep", "1"], check=True, capture_output=True, text=True)
    assert "kept unfinished steps written to within 1200s (--grace): [3]" in out.stdout, out.stdout
    assert chunk.exists()
    os.utime(chunk, (time.time() - 1300, time.time() - 1300))
    out = subprocess.run([*cli, "gc", root, "--keep", "1"], check=True, capture_output=True, text=True)
    assert "removed steps: [3]" in out.stdout and not chunk.parent.parent.exists(), out.stdout
    subprocess.run([*cli, "gc", root, "--keep", "0"], check=True, capture_output=True)
    assert (tmp_path / "ckpt" / "step_4" / "_ckptd" / "COMMITTED").exists()  # never the only committed step
    out = subprocess.run([*cli, "ls", root, "--json"], check=True, capture_output=True, text=True)
    rows = json.loads(out.stdout)
    assert [(r["step"], r["committed"], r["layout"]) for r in rows] == [(4, True, None)]  # not a Megatron step


def test_coordinator_failure_reaches_other_nodes_and_retry_commits(start_daemon, tmp_path):
    root = str(tmp_path / "ckpt")
    d0 = start_daemon(root, "node0", "--part-timeout", "1")
    d1 = start_daemon(root, "node1")
    sockets = [d0.socket, d1.socket]
    clients = {r: client_for(sockets, r, 4, 2) for r in range(4)}
    # rank 1 never saves: node 0 abandons the step and says so; node 1 learns it from storage at once
    handles = {r: clients[r].save(30, expected_state(r, 4, 30)) for r in (0, 2, 3)}
    t0 = time.monotonic()
    for r in (2, 3):
        with pytest.raises(SaveTimeoutError, match="failed on the coordinator"):
            handles[r].wait(60)
    assert time.monotonic() - t0 < 30  # not the 600 s commit timeout
    assert (tmp_path / "ckpt" / "step_30" / "_ckptd" / "FAILED").exists()
    # node 1's part of the failed (unnamed) attempt goes: left, the retry's coordinator could commit it with
    # node 0's new part before node 1's retry began (seen once in CI: the retry then met "already committed")
    stale = tmp_path / "ckpt" / part_key(30, 1)
    deadline = time.monotonic() + 10
    while stale.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stale.exists()
    # the same step saved again by all ranks commits: the old failure note does not poison the retry
    for c in clients.values():
        with contextlib.suppress(CkptdError):
            c._raise_background_errors()  # consume the reported failure
    retry = [clients[r].save(30, expected_state(r, 4, 30)) for r in range(4)]
    for h in retry:
        h.wait(60)
    assert (tmp_path / "ckpt" / "step_30" / "_ckptd" / "COMMITTED").exists()
    assert not (tmp_path / "ckpt" / "step_30" / "_ckptd" / "FAILED").exists()
