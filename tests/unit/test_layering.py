"""The package layering (STYLE.md): writer imports neither client nor daemon; client never imports the daemon;
the client's save path loads no zarr/fsspec and starts no thread, so training processes stay fork-safe."""

from __future__ import annotations

import ast
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
