"""In-memory restore after a rollback, on a real daemon: steps 10 and 20 committed, step 20 deleted from
storage, training resumed from 10 and saving 11, 12. The daemon keeps the newest commit by commit order
(12, not the larger 20 it committed earlier), and step 20, committed by this daemon but deleted since,
may be saved again; a step still committed in storage may not."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, Placement
from ckptd.client.protocol import StepState
from ckptd.client.reader import load
from ckptd.client.restore import arena_source
from ckptd.testing.launch import DaemonProcess
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import StepCommittedError
from ckptd.writer.root import open_root

N = 1000


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(N, dtype=torch.float32) + step}


def _from_memory(client: CheckpointClient, step: int) -> torch.Tensor | None:
    """The daemon's in-memory copy of ``step``'s ``x`` (None: not held)."""
    source = arena_source(client, step)
    if source is None:
        return None
    (shard,) = source.shards.values()
    raw = bytes(source.view[shard.offset : shard.offset + shard.nbytes])
    return torch.frombuffer(bytearray(raw), dtype=torch.float32)


async def _delete_step(root: str, step: int) -> None:
    async with open_root(root) as r:
        await CheckpointWriter(r.backend).delete_step(step)


def test_restore_and_resave_after_a_rollback(start_daemon: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    daemon = start_daemon(root)
    client = CheckpointClient(daemon.socket, placement=Placement(0, 1, 1, 0), timeout_s=20)
    try:
        for step in (10, 20):
            assert client.save(step, _state(step)).wait(30).state is StepState.COMMITTED
        held = _from_memory(client, 20)
        assert held is not None and torch.equal(held, _state(20)["x"])

        asyncio.run(_delete_step(root, 20))  # the rollback: training resumes from step 10
        assert not os.path.exists(os.path.join(root, "step_20"))
        for step in (11, 12):
            assert client.save(step, _state(step)).wait(30).state is StepState.COMMITTED
        held = _from_memory(client, 12)
        assert held is not None and torch.equal(held, _state(12)["x"])  # the newest commit, from memory
        assert _from_memory(client, 20) is None

        with pytest.raises(StepCommittedError):  # still committed in storage: refused, as before
            client.save(10, _state(10)).wait(30)
        again = {"x": _state(20)["x"] * 2}
        # committed by this daemon, but deleted since: saved again
        assert client.save(20, again).wait(30).state is StepState.COMMITTED
        held = _from_memory(client, 20)
        assert held is not None and torch.equal(held, again["x"])
    finally:
        client.close()
    out = {"x": torch.zeros(N)}
    load(root, 20, out)
    assert torch.equal(out["x"], again["x"])
