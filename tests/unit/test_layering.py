"""The package layering (STYLE.md): the import contracts in pyproject.toml's ``[tool.importlinter]`` hold
(writer imports neither client nor daemon; client never imports the daemon; the save path imports no
zarr/fsspec/s3fs/megatron; the library never imports ckptd.testing), and the client's save path starts no
thread at import, so training processes stay fork-safe."""

from __future__ import annotations

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
