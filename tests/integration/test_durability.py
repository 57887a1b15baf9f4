"""How a step's chunks on a local root are written and become durable before the node's part claims them:
a chunk of at least 1 MiB is fsynced as it is written (and its folder before the part), while a step with
smaller ones is made durable by one sync of the filesystem, not by one fsync per file and folder; blocks of
one small chunk each are written many per worker-thread call."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.reader import read_commit
from ckptd.daemon.writes import BATCH_CHUNKS


def test_small_chunks_are_made_durable_by_one_filesystem_sync(start_daemon, tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0", env={"CKPTD_LOG_LEVEL": "DEBUG"})
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    small = {f"s{i}": Shard(f"s{i}", torch.full((64,), float(i)), (64,), (0,)) for i in range(8)}
    client.save(1, small).wait(30)
    big = {"w": Shard("w", torch.arange(1 << 19, dtype=torch.float32), (1 << 19,), (0,))}  # one 2 MiB chunk
    client.save(2, big).wait(30)
    client.close()
    assert d.log_path is not None
    log = Path(d.log_path).read_text()
    assert re.search(r"step=1 node=0 data written .* durable .* later \(by one filesystem sync\)", log), log
    step2 = re.search(r"step=2 node=0 data written .* durable .* later.*", log)
    assert step2 is not None and "filesystem sync" not in step2.group(0), log
    assert sorted(a.name for a in read_commit(root, 1).arrays) == [f"s{i}" for i in range(8)]
    assert [a.name for a in read_commit(root, 2).arrays] == ["w"]


def test_small_blocks_written_in_batches_reload_bit_exact_and_verify(start_daemon, tmp_path) -> None:
    """Blocks of one small chunk each are written many per worker-thread call: more than a batch of them, a
    rank's block cut by the array's end (stored padded to the whole chunk), a 0-d tensor, and a large block
    written chunk by chunk beside them; two ranks of one node. Every value reloads bit-exact, ``ckptd
    verify`` passes, and zarr-python reads the padded array as saved."""
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0")
    g = torch.Generator().manual_seed(3)
    small = [torch.randn(16, generator=g) for _ in range(2 * BATCH_CHUNKS + 5)]
    rows = torch.randn(6, 3, generator=g)
    big = torch.randn(1 << 19, generator=g)  # 2 MiB a rank: not batched

    def state(rank: int, like: bool = False) -> dict[str, Any]:
        def t(x: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(x) if like else x.clone()

        lo = 4 * rank  # rank 0 rows 0..3, rank 1 rows 4..5 of a (4, 3) chunk grid: its block is cut
        return {
            "small": {str(i): Shard(f"small/{i}", t(x[8 * rank : 8 * rank + 8]), (16,), (8 * rank,))
                      for i, x in enumerate(small)},
            "rows": Shard("rows", t(rows[lo : lo + 4]), (6, 3), (lo, 0), chunk_shape=(4, 3)),
            "scalar": Shard(f"scalar{rank}", t(torch.tensor(float(rank) + 0.5)), (), ()),
            "big": Shard("big", t(big[None] * (rank + 1)), (2, 1 << 19), (rank, 0)),
        }

    clients = [CheckpointClient(d.socket, placement=Placement(r, 2, 2, 0)) for r in (0, 1)]
    handles = [c.save(1, state(r)) for r, c in enumerate(clients)]
    for h in handles:
        h.wait(60)
    for r, c in enumerate(clients):
        template = state(r, like=True)
        c.load(1, template)
        for (key, got), (_, want) in zip(_leaves(template), _leaves(state(r)), strict=True):
            assert torch.equal(got.data, want.data), key
        c.close()
    out = subprocess.run([sys.executable, "-m", "ckptd.daemon.cli", "verify", root, "--json"], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0 and json.loads(out.stdout)[0]["ok"], out.stdout + out.stderr
    assert np.array_equal(zarr.open_array(f"{root}/step_1/rows", mode="r")[:], rows.numpy())
    assert (Path(root) / "step_1" / "small" / "7" / "c.1").is_file()  # format 4's chunk keys


def _leaves(state: dict[str, Any], prefix: str = "") -> list[tuple[str, Shard]]:
    out = []
    for k, v in state.items():
        out.extend(_leaves(v, f"{prefix}{k}/") if isinstance(v, dict) else [(f"{prefix}{k}", v)])
    return out
