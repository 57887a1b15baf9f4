"""The package layering (STYLE.md): writer imports neither client nor daemon; client never imports the daemon;
the client's save path loads no zarr/fsspec and starts no thread, so training processes stay fork-safe."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _imports(folder: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (REPO / folder).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = names
    return found


def test_writer_imports_neither_client_nor_daemon():
    bad = {f: sorted(n for n in names if n.startswith(("ckptd.client", "ckptd.daemon")))
           for f, names in _imports("writer").items()}
    assert not any(bad.values()), bad


def test_client_never_imports_the_daemon():
    bad = {f: sorted(n for n in names if n.startswith("ckptd.daemon")) for f, names in _imports("client").items()}
    assert not any(bad.values()), bad


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

    from ckptd.writer.arrays import ChunkSink
    from ckptd.writer.backends import open_backend
    from ckptd.writer.commit import CheckpointWriter
    from ckptd.writer.format import FORMAT_VERSION, ArrayRecord, ChunkRecord, PartManifest, ShardRecord, chunk_key

    root = str(tmp_path / "root")

    async def make() -> None:
        async with await open_backend(root) as backend:
            data = np.arange(16, dtype=np.float32)
            crc = await ChunkSink(backend).put(f"step_2/w/{chunk_key((0,))}", data)
            rec = ArrayRecord("w", "float32", [16], [16], [ShardRecord(0, [0], [16], [ChunkRecord([0], 64, crc)])])
            writer = CheckpointWriter(backend)
            await writer.write_part(PartManifest(format=FORMAT_VERSION, step=2, node=0, num_nodes=1, world_size=1,
                                                 ranks=[0], arrays=[rec], objects={}, nbytes=64, written_at=0.0))
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
