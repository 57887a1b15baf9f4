"""In-memory restore: after the training ranks are killed (the node and its daemon live), new ranks load
the newest committed step from the daemon's arena instead of storage, bit-exact; a damaged in-memory copy
and a step the daemon no longer keeps fall back to storage; a save that needs the space evicts it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from test_reshard_dp import _digest

from ckptd.client import CheckpointClient
from ckptd.client.megatron import load_checkpoint, save_checkpoint
from ckptd.client.protocol import ShardMeta
from ckptd.client.restore import arena_source
from ckptd.daemon.arena import Arena
from ckptd.daemon.restore import Retention
from ckptd.testing.launch import DaemonProcess, run_ranks
from ckptd.testing.toy_gpt import build_gpt
from ckptd.writer.errors import BackpressureError

pytestmark = pytest.mark.megatron
K = 2
BUILD = {"overlap_grad_reduce": True, "bucket_size": 6000}


def _save_and_die(rank: int, world: int, socket: str, out: str) -> None:
    model, optimizer, train_step = build_gpt(**BUILD)
    client = CheckpointClient(socket)
    for i in range(K):
        train_step(i)
    save_checkpoint(client, K, model, optimizer, extra={"iteration": K}).wait(60)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"digest": _digest(model, optimizer)}))
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close, no goodbye


def _scramble(model: list[torch.nn.Module], optimizer: Any) -> None:
    """Overwrite, in place, every value :func:`_digest` covers (params, main params, optimizer states)."""
    with torch.no_grad():
        for chunk in model:
            for p in chunk.parameters():
                p.fill_(-3.25)
        for opt in optimizer.chained_optimizers:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    p.fill_(-3.25)
                    for value in opt.optimizer.state.get(p, {}).values():
                        if isinstance(value, torch.Tensor):
                            value.fill_(7)


def _restart(rank: int, world: int, socket: str, root: str, saved: str) -> dict[str, Any]:
    model, optimizer, train_step = build_gpt(seed=4321, data_seed=1234, **BUILD)
    client = CheckpointClient(socket)
    out: dict[str, Any] = {}
    loaded = load_checkpoint(client, K, model, optimizer)
    out["memory"] = (loaded.from_memory_bytes, _digest(model, optimizer) == saved)
    _scramble(model, optimizer)  # so that the storage load below must write every value back
    assert _digest(model, optimizer) != saved
    loaded = load_checkpoint(root, K, model, optimizer)  # storage only: the reference
    out["storage"] = (loaded.from_memory_bytes, _digest(model, optimizer) == saved)
    # a damaged in-memory copy: the regions that fail their checksum come from storage
    source = arena_source(client, K)
    assert source is not None
    if rank == 0:
        assert client._staging.mm is not None
        # a slice of an optimizer bucket that DP rank 0 reads itself (its slice starts at 0); model params
        # that lie inside a rank's own (fp32) main params are not read from the model arrays at all
        for shard in source.shards.values():
            if shard.key.startswith("optim/") and shard.global_offset[0] == 0 and shard.nbytes:
                client._staging.mm[shard.offset] ^= 0xFF
                break
    _scramble(model, optimizer)  # what the damaged regions fall back to must really be read
    loaded = load_checkpoint(client, K, model, optimizer)
    out["damaged"] = (loaded.from_memory_bytes, _digest(model, optimizer) == saved)
    # a newer commit replaces the kept step: the old step comes from storage, the new one from memory
    train_step(K)
    save_checkpoint(client, K + 1, model, optimizer).wait(60)
    newer = _digest(model, optimizer)
    out["stale"] = load_checkpoint(client, K, model, optimizer).from_memory_bytes
    loaded = load_checkpoint(client, K + 1, model, optimizer)
    out["newer"] = (loaded.from_memory_bytes, _digest(model, optimizer) == newer)
    return out


def test_restore_from_memory_after_the_ranks_were_killed(tmp_path: Path, sockdir: str) -> None:
    root = str(tmp_path / "ckpt")
    daemon = DaemonProcess(root, f"{sockdir}/d.sock", "--arena-size", "64MiB", "--no-prefault",
                           log_path=str(tmp_path / "daemon.log")).wait_ready()
    try:
        run_ranks(_save_and_die, 2, daemon.socket, str(tmp_path), may_exit=[0, 1])
        saved = [json.loads((tmp_path / f"rank{r}.json").read_text())["digest"] for r in range(2)]
        results = [run_ranks(_restart, 2, daemon.socket, root, saved[0])[0]]
    finally:
        daemon.stop(timeout=20)
    del saved
    r = results[0]
    assert r["memory"][0] > 0 and r["memory"][1], r  # served from memory, bit-exact
    assert r["storage"] == (0, True), r
    full = r["memory"][0]
    assert 0 < r["damaged"][0] < full and r["damaged"][1], r  # the damaged region fell back to storage
    assert r["stale"] == 0, r
    assert r["newer"][0] > 0 and r["newer"][1], r


async def _kept(arena: Arena) -> Retention:
    """Step 3 committed and kept: 600 KiB of a 1 MiB arena."""
    kept = Retention(arena)
    lease = await arena.lease(1, [600 << 10], timeout=0)
    meta = ShardMeta("w", "uint8", [600 << 10], [0], [600 << 10], [600 << 10], 0)
    assert kept.keep(3, meta, lease)
    kept.step_committed(3)
    return kept


def test_a_save_evicts_the_kept_step() -> None:
    async def go() -> tuple[int, int, list[int]]:
        arena = Arena(1 << 20, prefault=False)
        try:
            kept = await _kept(arena)
            before = len(kept.reply(3).shards)
            again = await arena.lease(2, [600 << 10], timeout=0)  # does not fit next to the kept bytes
            return before, len(kept.reply(3).shards), again.offsets
        finally:
            arena.close()

    before, after, offsets = asyncio.run(go())
    assert (before, after, offsets) == (1, 0, [0])


def test_a_lease_asked_for_ahead_never_evicts_the_kept_step() -> None:
    """The lease a save asks for on behalf of the next one (``LeaseRequest.ahead``) comes from free space
    only: the kept step stays for an in-memory restore, and the next save leases (and evicts) when it runs."""
    async def go() -> tuple[str, int]:
        arena = Arena(1 << 20, prefault=False)
        try:
            kept = await _kept(arena)
            try:
                await arena.lease(2, [600 << 10], timeout=0, ahead=True)
                refused = ""
            except BackpressureError as exc:
                refused = type(exc).__name__
            return refused, len(kept.reply(3).shards)
        finally:
            arena.close()

    assert asyncio.run(go()) == ("BackpressureError", 1)


def test_a_lease_asked_for_ahead_never_takes_space_a_waiting_save_needs() -> None:
    """Space freed while a save waits goes to that save, even when a lease asked for ahead comes first."""
    async def go() -> tuple[str, list[int]]:
        arena = Arena(1 << 20, prefault=False)
        try:
            first = await arena.lease(1, [800 << 10], timeout=0)
            waiting = asyncio.create_task(arena.lease(2, [600 << 10], timeout=10))
            await asyncio.sleep(0)  # the save is waiting now
            arena.release(first)  # its space is back; the waiter has not run yet
            try:
                await arena.lease(3, [600 << 10], timeout=0, ahead=True)
                refused = ""
            except BackpressureError as exc:
                refused = type(exc).__name__
            return refused, (await waiting).offsets
        finally:
            arena.close()

    assert asyncio.run(go()) == ("BackpressureError", [0])
