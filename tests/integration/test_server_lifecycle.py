"""The server lifecycle in-process: an injected shutdown event stops it (no signals), drain then cancel."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import torch

from ckptd.client import CheckpointClient, Placement
from ckptd.client.protocol import StepState
from ckptd.client.reader import load
from ckptd.daemon.config import DaemonConfig, load_config
from ckptd.daemon.server import serve


def config(tmp_path: Path, **flags: object) -> DaemonConfig:
    return load_config(
        {"root": str(tmp_path / "ckpt"), "socket": str(tmp_path / "run" / "d.sock"), "arena_size": "8MiB",
         "prefault": False, "nice": 0, "stage_grace_s": 0, **flags},
        {},
    )


def test_shutdown_event_stops_an_idle_server_with_a_client_connected(tmp_path: Path) -> None:
    cfg = config(tmp_path)

    async def scenario() -> int:
        shutdown, ready = asyncio.Event(), asyncio.Event()
        server = asyncio.create_task(serve(cfg, shutdown=shutdown, ready=ready, handle_signals=False))
        await asyncio.wait_for(ready.wait(), 30)
        assert os.path.exists(cfg.socket)
        client = await asyncio.to_thread(CheckpointClient, cfg.socket, placement=Placement(0, 1, 1, 0))
        try:
            shutdown.set()  # an idle connection must not keep the server up
            return await asyncio.wait_for(server, 30)
        finally:
            client.close()

    assert asyncio.run(scenario()) == 0
    assert not os.path.exists(cfg.socket)


def test_shutdown_drains_a_save_in_flight_then_exits(tmp_path: Path) -> None:
    cfg = config(tmp_path, drain_grace_s=60)
    data = torch.arange(4096, dtype=torch.float32)

    async def scenario() -> tuple[int, StepState]:
        shutdown, ready = asyncio.Event(), asyncio.Event()
        server = asyncio.create_task(serve(cfg, shutdown=shutdown, ready=ready, handle_signals=False))
        await asyncio.wait_for(ready.wait(), 30)
        client = await asyncio.to_thread(CheckpointClient, cfg.socket, placement=Placement(0, 1, 1, 0))
        try:
            handle = await asyncio.to_thread(client.save, 3, {"w": data})
            shutdown.set()  # while the step may still be writing: it finishes within the grace period
            await asyncio.to_thread(handle.wait, 30)
            return await asyncio.wait_for(server, 30), handle.state
        finally:
            client.close()

    code, state = asyncio.run(scenario())
    assert (code, state) == (0, StepState.COMMITTED)
    out = {"w": torch.zeros(4096)}
    load(str(tmp_path / "ckpt"), 3, out)
    assert torch.equal(out["w"], data)


def test_steps_unfinished_after_the_grace_period_are_cancelled(tmp_path: Path) -> None:
    cfg = config(tmp_path, drain_grace_s=0.5)

    async def scenario() -> tuple[int, float]:
        shutdown, ready = asyncio.Event(), asyncio.Event()
        server = asyncio.create_task(serve(cfg, shutdown=shutdown, ready=ready, handle_signals=False))
        await asyncio.wait_for(ready.wait(), 30)
        # rank 0 of a node with two local ranks: the step waits (part_timeout_s, 600 s) for rank 1
        client = await asyncio.to_thread(CheckpointClient, cfg.socket, placement=Placement(0, 2, 2, 0))
        try:
            handle = await asyncio.to_thread(client.save, 1, {"w": torch.ones(16)})
            assert handle.state is StepState.PENDING
            t0 = asyncio.get_running_loop().time()
            shutdown.set()
            code = await asyncio.wait_for(server, 30)
            return code, asyncio.get_running_loop().time() - t0
        finally:
            client.close()

    code, took = asyncio.run(scenario())
    assert code == 1  # cut off: it will not commit
    assert took < 10  # the waiting step was cancelled, not waited for
