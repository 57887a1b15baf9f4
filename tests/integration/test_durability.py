"""How a step's chunks on a local root become durable before the node's part claims them: a chunk of at
least 1 MiB is fsynced as it is written (and its folder before the part), while a step with smaller ones
is made durable by one sync of the filesystem, not by one fsync per file and folder."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.reader import read_commit


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
