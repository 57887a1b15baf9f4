"""How a step's chunks on a local root are written and become durable before the node's part claims them:
a chunk of at least 1 MiB is fsynced as it is written (and its folder before the part), while a step with
smaller ones is made durable by one sync of the filesystem, not by one fsync per file and folder; blocks of
one small chunk each are written many per worker-thread call."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.reader import read_commit
from ckptd.daemon.config import load_config
from ckptd.daemon.server import serve
from ckptd.daemon.writes import BATCH_CHUNKS
from ckptd.writer.backends import local as local_backend


class _DurabilityTrace:
    """What the in-process daemon does to the files of a root, in the order it happens: a file under the root
    opened for writing (``open``) and closed (``close``), an ``fsync`` that returned (of a file or folder, by
    the path its descriptor names), a ``syncfs`` that returned (by the filesystem's device) and a rename into
    place (``replace``, recorded before it runs). Wraps the real primitives (``os.open``, ``os.close``,
    ``os.fsync``, ``os.replace``, the local backend's ``syncfs``); every call goes through to them."""

    def __init__(self, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = os.path.realpath(root)
        self.events: list[tuple[str, str | int]] = []
        self._writing: dict[int, str] = {}
        real_open, real_close, real_fsync, real_replace = os.open, os.close, os.fsync, os.replace
        real_libc = local_backend._LIBC
        trace = self

        def traced_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            fd = real_open(path, flags, *args, **kwargs)
            full = os.path.realpath(os.fsdecode(path))
            if flags & (os.O_WRONLY | os.O_RDWR) and trace._under_root(full):
                trace._writing[fd] = full
                trace.events.append(("open", full))
            return fd

        def traced_close(fd: int) -> None:
            path = trace._writing.pop(fd, None)
            real_close(fd)
            if path is not None:
                trace.events.append(("close", path))

        def traced_fsync(fd: Any) -> None:
            fileno = fd if isinstance(fd, int) else fd.fileno()
            path = os.readlink(f"/proc/self/fd/{fileno}")
            real_fsync(fd)
            trace.events.append(("fsync", path))

        def traced_replace(src: Any, dst: Any, **kwargs: Any) -> None:
            trace.events.append(("replace", os.path.realpath(os.fsdecode(dst))))
            real_replace(src, dst, **kwargs)

        class TracedLibc:
            def syncfs(self, fd: int) -> int:
                rc = int(real_libc.syncfs(fd))
                if rc == 0:
                    trace.events.append(("syncfs", os.fstat(fd).st_dev))
                return rc

        monkeypatch.setattr(os, "open", traced_open)
        monkeypatch.setattr(os, "close", traced_close)
        monkeypatch.setattr(os, "fsync", traced_fsync)
        monkeypatch.setattr(os, "replace", traced_replace)
        monkeypatch.setattr(local_backend, "_LIBC", TracedLibc())

    def _under_root(self, path: str) -> bool:
        return path.startswith(self.root + os.sep)

    def step(self, step: int) -> dict[str, Any]:
        """How step ``step``'s data files (everything its node wrote under ``step_<n>/`` outside the control
        folder before its part manifest went into place) became durable by then: the files, which of them,
        and which of their folders, no ``fsync`` nor ``syncfs`` had covered when the part was written, and how
        many fsyncs of those files and syncs of the filesystem ran between the step's first write and its part."""
        folder = os.path.join(self.root, f"step_{step}")
        part = os.path.join(folder, "_ckptd", "_parts", "node-0.json")
        at_part = next(i for i, (kind, what) in enumerate(self.events) if kind == "replace" and what == part)
        before = self.events[:at_part]
        opened: dict[str, int] = {}
        closed: dict[str, int] = {}
        for i, (kind, what) in enumerate(before):
            if kind in ("open", "close") and isinstance(what, str) and what.startswith(folder + os.sep) \
                    and not what.startswith(os.path.join(folder, "_ckptd") + os.sep):
                (opened if kind == "open" else closed)[what] = i
        first = min(opened.values(), default=at_part)

        def covered(path: str, written_from: int, written_by: int) -> bool:
            """An fsync of ``path`` after it was opened for this write, or a sync of its filesystem after the
            write was done (closed), both before the part."""
            dev = os.stat(path).st_dev
            return any((kind == "fsync" and what == path and i > written_from)
                       or (kind == "syncfs" and what == dev and i > written_by)
                       for i, (kind, what) in enumerate(before))

        files = sorted(opened)
        return {
            "files": files,
            "unclosed": [f for f in files if f not in closed],
            "files_not_durable": [f for f in files if not covered(f, opened[f], closed.get(f, at_part))],
            "folders_not_durable": [f for f in files
                                    if not covered(os.path.dirname(f), opened[f], closed.get(f, at_part))],
            "file_fsyncs": sum(1 for kind, what in before[first:] if kind == "fsync" and what in opened),
            "syncfs": sum(1 for kind, _ in before[first:] if kind == "syncfs"),
        }


def test_small_chunks_are_made_durable_by_one_filesystem_sync(
    tmp_path: Path, sockdir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In-process (the daemon's own write path, on a real filesystem): before a node's part manifest claims
    its data, every chunk file it wrote, and the folder naming it, is durable — by an ``fsync`` of its own
    after the write, or a ``syncfs`` of its filesystem after the write was done. Chunks under 1 MiB get one
    ``syncfs`` for the step and no fsync each; a 2 MiB chunk is fsynced as it is written, with no ``syncfs``."""
    root = str(tmp_path / "ckpt")
    cfg = load_config({"root": root, "socket": os.path.join(sockdir, "d.sock"), "arena_size": "16MiB",
                       "prefault": False, "nice": 0}, {})
    trace = _DurabilityTrace(root, monkeypatch)
    caplog.set_level(logging.DEBUG, logger="ckptd.daemon.service")
    small = {f"s{i}": Shard(f"s{i}", torch.full((64,), float(i)), (64,), (0,)) for i in range(8)}
    big = {"w": Shard("w", torch.arange(1 << 19, dtype=torch.float32), (1 << 19,), (0,))}  # one 2 MiB chunk

    def save() -> None:
        client = CheckpointClient(cfg.socket, placement=Placement(0, 1, 1, 0))
        try:
            client.save(1, small).wait(30)
            client.save(2, big).wait(30)
        finally:
            client.close()

    async def scenario() -> int:
        shutdown, ready = asyncio.Event(), asyncio.Event()
        server = asyncio.create_task(serve(cfg, shutdown=shutdown, ready=ready, handle_signals=False))
        await asyncio.wait_for(ready.wait(), 30)
        try:
            await asyncio.to_thread(save)
        finally:
            shutdown.set()
        return await asyncio.wait_for(server, 30)

    assert asyncio.run(scenario()) == 0
    step1, step2 = trace.step(1), trace.step(2)
    assert len(step1["files"]) == 8 and len(step2["files"]) == 1, (step1, step2)
    on_disk = {str(p) for s in (1, 2) for p in Path(trace.root, f"step_{s}").rglob("c*")
               if p.is_file() and "_ckptd" not in p.parts}
    assert on_disk == {*step1["files"], *step2["files"]}, on_disk  # no chunk was written past the trace
    for step in (step1, step2):
        assert not step["unclosed"], step
        assert not step["files_not_durable"], step
        assert not step["folders_not_durable"], step
    assert (step1["file_fsyncs"], step1["syncfs"]) == (0, 1), step1  # one filesystem sync, no fsync each
    assert (step2["file_fsyncs"], step2["syncfs"]) == (1, 0), step2  # fsynced as written

    log = caplog.text
    assert re.search(r"step=1 node=0 data written .* durable .* later \(by one filesystem sync\)", log), log
    step2_line = re.search(r"step=2 node=0 data written .* durable .* later.*", log)
    assert step2_line is not None and "filesystem sync" not in step2_line.group(0), log
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
