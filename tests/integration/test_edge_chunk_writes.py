"""A daemon-written shard that spans several chunks of its grid, the last cut by the array's end: every chunk
is written (the edge one stored whole, padded, and recorded at the whole chunk's size), so the step reloads
bit-exact through a client and ``ckptd verify`` passes; zarr-python reads the array as saved."""

from __future__ import annotations

import numpy as np
import torch
import zarr

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.protocol import StepState
from ckptd.client.reader import read_commit
from ckptd.daemon.cli import main


def test_a_shard_of_several_chunks_with_an_edge_chunk_reloads_and_verifies(start_daemon, tmp_path, capsys) -> None:
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0")
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(10, 3, generator=g)  # chunks of 4 rows: [0, 4), [4, 8), [8, 10) cut by the end
    both = torch.randn(5, 7, generator=g)  # chunks of (2, 3): cut along both axes

    def state(like: bool = False) -> dict[str, Shard]:
        def t(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(x) if like else x.clone()

        return {"rows": Shard("rows", t(rows), (10, 3), (0, 0), chunk_shape=(4, 3)),
                "both": Shard("both", t(both), (5, 7), (0, 0), chunk_shape=(2, 3))}

    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
    try:
        assert client.save(1, state()).wait(60).state is StepState.COMMITTED
        template = state(like=True)
        client.load(1, template)
        assert torch.equal(template["rows"].data, rows) and torch.equal(template["both"].data, both)
    finally:
        client.close()

    commit = read_commit(root, 1)
    recs = {a.name: a for a in commit.arrays}
    for name, chunks, n in (("rows", (4, 3), 3), ("both", (2, 3), 9)):
        got = [ch for shard in recs[name].shards for ch in shard.chunks]
        assert len(got) == n, name
        assert all(ch.nbytes == int(np.prod(chunks)) * 4 for ch in got), name  # edge chunks stored whole
    assert main(["verify", root, "--step", "1"]) == 0, capsys.readouterr()
    assert np.array_equal(zarr.open_array(f"{root}/step_1/rows", mode="r")[:], rows.numpy())
    assert np.array_equal(zarr.open_array(f"{root}/step_1/both", mode="r")[:], both.numpy())
