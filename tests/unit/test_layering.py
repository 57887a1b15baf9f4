"""The package layering (STYLE.md): the import contracts in pyproject.toml's ``[tool.importlinter]`` hold
(writer imports neither client nor daemon; client never imports the daemon; the save path imports no
zarr/fsspec/s3fs/megatron; the library never imports ckptd.testing), and the client's save path starts no
thread at import, so training processes stay fork-safe."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
PARTS = ("client", "daemon", "writer", "testing")


def _lint_imports(repo: pathlib.Path) -> subprocess.CompletedProcess[str]:
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    command = [str(exe)] if exe.exists() else [sys.executable, "-c",
                                               "from importlinter.cli import lint_imports_command as c; c()"]
    # the given checkout's sources first: grimp resolves each root package to its first portion on sys.path
    path = os.pathsep.join([*(str(repo / p) for p in PARTS), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([*command, "--config", str(repo / "pyproject.toml"), "--no-cache"], cwd=repo,
                          env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=120)


def test_import_contracts_hold():
    out = _lint_imports(REPO)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", out.stdout)
    assert kept and int(kept.group(1)) >= 4, out.stdout[-3000:]


def test_import_contracts_catch_a_violation(tmp_path):
    """The contracts see the real sources: one forbidden import added to a copy of the tree breaks one."""
    for part in PARTS:
        shutil.copytree(REPO / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    errors = tmp_path / "writer" / "ckptd" / "writer" / "errors.py"
    errors.write_text(errors.read_text() + "\nimport ckptd.daemon  # noqa\n")
    out = _lint_imports(tmp_path)
    assert out.returncode != 0, out.stdout[-3000:]
    assert "ckptd.writer.errors -> ckptd.daemon" in out.stdout, out.stdout[-3000:]


def test_client_save_path_is_light_and_threadless():
    code = (
        "import sys, threading, ckptd.client, ckptd.client.megatron\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('zarr', 'fsspec', 's3fs', 'megatron'))\n"
        "print(heavy, threading.active_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[] 1", out


def test_offline_ls_and_verify_import_no_torch(tmp_path: pathlib.Path) -> None:
    """``ckptd ls`` and ``verify`` read storage only: a committed step (with a merged manifest to look at)
    is listed and verified without torch (or megatron) ever being imported."""
    import asyncio

    import numpy as np

    from ckptd.writer import format as fmt
    from ckptd.writer.arrays import ChunkSink
    from ckptd.writer.backends import open_backend
    from ckptd.writer.commit import CheckpointWriter

    root = str(tmp_path / "root")

    async def make() -> None:
        async with await open_backend(root) as backend:
            data = np.arange(16, dtype=np.float32)
            crc, _ = await ChunkSink(backend).put(f"step_2/w/{fmt.chunk_key((0,), fmt.CHUNK_SEPARATOR)}", data)
            shard = fmt.ShardRecord(0, [0], [16], [fmt.ChunkRecord([0], 64, crc)])
            rec = fmt.ArrayRecord("w", "float32", [16], [16], [shard], separator=fmt.CHUNK_SEPARATOR)
            writer = CheckpointWriter(backend)
            await writer.write_part(fmt.PartManifest(format=fmt.FORMAT_VERSION, step=2, node=0, num_nodes=1,
                                                     world_size=1, ranks=[0], arrays=[rec], objects={}, nbytes=64,
                                                     written_at=0.0))
            await writer.commit(2, 1, timeout=10)

    asyncio.run(make())
    code = (
        "import io, json, sys, contextlib\n"
        "from ckptd.daemon.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    rcs = [main(['ls', {root!r}, '--json']), main(['verify', {root!r}, '--json'])]\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
        "print(json.dumps([rcs, heavy, out.getvalue().splitlines()]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    rcs, heavy, lines = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rcs == [0, 0] and heavy == [], (rcs, heavy, proc.stderr)
    listed, verified = json.loads(lines[0]), json.loads(lines[1])
    assert [(r["step"], r["committed"], r["merged"]) for r in listed] == [(2, True, False)]
    assert verified[0]["ok"] and verified[0]["bytes"] == 64
