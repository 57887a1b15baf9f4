"""Expert parallelism: a mixture-of-experts GPT (4 experts, allgather dispatcher, megatron-core on CPU through
the shim) saved at EP2 loads merge-free at EP1 (experts gathered on one rank, DP 2 -> 1) and at EP1 with
DP 2 (the experts' DP group grows from 1 to 2), straight from the stored DP bucket slices of the expert and
dense buffers, bit-identical to the load from the merged layout of a merged copy; training then continues
with the original run's losses (to REL_TOL: the expert outputs may be summed in another order). The control
drops the optimizer moments after the same load and misses them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from test_reshard_dp import _digest

from ckptd.client import CheckpointClient
from ckptd.client.megatron import get_layout, load_checkpoint, save_checkpoint
from ckptd.testing.toy_gpt import build_gpt, spawn_ranks

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(240)]

K, AFTER = 2, 2
REL_TOL = 1e-6
MOE = {"experts": 4}


def _save(rank: int, world: int, socket: str) -> list[float]:
    model, optimizer, train_step = build_gpt(ep=2, **MOE)
    for i in range(K):
        train_step(i)
    save_checkpoint(CheckpointClient(socket), K, model, optimizer).wait(60)
    return [train_step(K + i) for i in range(AFTER)]


def _load(rank: int, world: int, roots: tuple[str, str], drop: bool) -> dict[str, Any]:
    model, optimizer, train_step = build_gpt(ep=1, seed=4321, data_seed=1234, **MOE)
    load_checkpoint(roots[0], K, model, optimizer)  # the merged layout
    via_merged = _digest(model, optimizer)
    load_checkpoint(roots[1], K, model, optimizer)  # merge-free
    same = _digest(model, optimizer) == via_merged
    if drop:  # control: the right params, the optimizer's moments zeroed
        for opt in optimizer.chained_optimizers:
            for state in opt.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        value.zero_()
    experts = sum(p.numel() for name, p in model[0].named_parameters() if ".experts." in name)
    return {"losses": [train_step(K + i) for i in range(AFTER)], "experts": experts, "same": same,
            "dp": get_layout(model, optimizer).dp_size}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, module_sockdir: str) -> tuple[tuple[str, str], list[float]]:
    from ckptd.testing.launch import DaemonProcess

    tmp = tmp_path_factory.mktemp("ep2")
    root = str(tmp / "ckpt")
    daemon = DaemonProcess(root, f"{module_sockdir}/ep.sock", "--arena-size", "64MiB", "--no-prefault",
                           log_path=str(tmp / "daemon.log")).wait_ready()
    try:
        losses = spawn_ranks(_save, 2, daemon.socket)[0]
    finally:
        daemon.stop(timeout=20)
    merged = str(tmp / "merged")
    shutil.copytree(root, merged)
    subprocess.run([sys.executable, "-m", "ckptd.daemon.cli", "merge", merged], check=True, capture_output=True)
    return (merged, root), losses


@pytest.mark.parametrize("world", [1, 2], ids=["ep2-1", "ep2-1-expert-dp2"])
def test_expert_parallel_load_without_merge(saved: tuple[tuple[str, str], list[float]], world: int) -> None:
    roots, original = saved
    results = spawn_ranks(_load, world, roots, False)
    for r in results:
        assert r["same"], "merge-free and merged loads differ"
        assert r["dp"] == world and r["experts"] == 4 * 2 * 2 * 64 * 128 * 3 // 2, r  # all 4 experts on each rank
        assert all(abs(x - y) <= REL_TOL * abs(y) for x, y in zip(r["losses"], original, strict=True)), (
            r["losses"], original)
    if world > 1:
        return
    dropped = spawn_ranks(_load, world, roots, True)[0]["losses"]
    assert abs(dropped[1] - original[1]) > 10 * REL_TOL * abs(original[1]), (dropped, original)
