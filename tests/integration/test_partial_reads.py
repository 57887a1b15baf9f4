"""A daemon-written chunk of several 1 MiB pieces, read in part: the load reads and checks only the pieces
holding elements it needs (as a load at another TP reads each param's part of a bucket slice), and
``ckptd verify`` still checks every byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.reader import load, read_commit
from ckptd.writer.checksum import crc32c, pack_pieces
from ckptd.writer.errors import CorruptCheckpointError

MiB = 1 << 20
N = (7 * MiB // 2) // 4  # float32 elements in 3.5 MiB: one chunk of four pieces, the last one half


def test_a_partial_read_checks_the_pieces_it_reads_and_verify_checks_all(start_daemon, tmp_path: Path) -> None:
    d = start_daemon(str(tmp_path / "ckpt"), "d0", arena="32MiB")
    data = torch.randn(N, generator=torch.Generator().manual_seed(3))
    CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0)).save(1, {"flat": data}).wait(60)

    chunk = next(a for a in read_commit(d.root, 1).arrays if a.name == "flat").shards[0].chunks[0]
    raw = data.numpy().tobytes()
    assert chunk.nbytes == 7 * MiB // 2 and chunk.crc32c == crc32c(raw)
    assert chunk.pieces == pack_pieces([crc32c(raw[a : a + MiB]) for a in range(0, len(raw), MiB)])

    # elements 0-999 lie in piece 0, elements 600,000-600,099 (bytes 2.29-2.29 MiB) in piece 2
    def partial() -> tuple[torch.Tensor, torch.Tensor]:
        head, mid = torch.zeros(1000), torch.zeros(100)
        load(d.root, 1, {"h": Shard("flat", head, (N,), (0,)), "m": Shard("flat", mid, (N,), (600_000,))})
        return head, mid

    path = tmp_path / "ckpt" / "step_1" / "flat" / "c.0"
    good = path.read_bytes()

    def flip(*positions: int) -> None:
        body = bytearray(good)
        for pos in positions:
            body[pos] ^= 0x01
        path.write_bytes(bytes(body))

    flip(MiB + 12345, 3 * MiB + 7)  # pieces 1 and 3: no element either region needs
    head, mid = partial()
    assert torch.equal(head, data[:1000]) and torch.equal(mid, data[600_000:600_100])
    verify = subprocess.run([sys.executable, "-m", "ckptd.daemon.cli", "verify", d.root], capture_output=True,
                            text=True)
    assert verify.returncode != 0 and "flat" in verify.stdout + verify.stderr  # every byte still checked there

    flip(2 * MiB + 99)  # piece 2: read, and caught
    with pytest.raises(CorruptCheckpointError, match=r"flat/c\.0: bytes \[2097152, 3145728\) \(piece 2\)"):
        partial()
    with pytest.raises(CorruptCheckpointError, match=r"flat/c\.0"):  # the whole array: checked whole
        load(d.root, 1, {"flat": torch.zeros(N)})
