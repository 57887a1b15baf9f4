"""Every example in docs/verl.md runs or is checked against the code it names.

The Hydra overrides (the first bash block) are composed with verl's own config in
``test_verl.py::test_documented_switch_reaches_ray_init``; the others are here: the ``install()`` block,
the own-daemon lines, and every ``ckptd`` command line (accepted by the CLI parser; the demo line runs in
``test_demo_verl.py``).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.daemon.cli import build_parser
from ckptd.integrations.verl import socket_for

DOC = (Path(__file__).parents[2] / "docs" / "verl.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", DOC, re.S)
MODULES = ("verl.utils.checkpoint.megatron_checkpoint_manager", "verl.workers.engine.megatron.transformer_impl")


def _bash(containing: str) -> str:
    found = [code for lang, code in BLOCKS if lang == "bash" and containing in code]
    assert len(found) == 1, f"one bash block with {containing!r} expected, found {len(found)}"
    return str(found[0])


def test_every_block_is_covered() -> None:
    """A new example needs a test: the blocks are exactly the ones this file and test_verl.py run."""
    assert [lang for lang, _ in BLOCKS] == ["bash", "python", "bash", "bash", "bash"], [b[0] for b in BLOCKS]
    assert "worker_process_setup_hook=" in BLOCKS[0][1]  # test_documented_switch_reaches_ray_init


def test_install_block_switches_verl(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip(MODULES[0])
    import importlib

    modules = [importlib.import_module(m) for m in MODULES]
    for m in modules:  # restored after the test: other tests see verl's own class
        monkeypatch.setattr(m, "MegatronCheckpointManager", m.MegatronCheckpointManager)
    (code,) = [code for lang, code in BLOCKS if lang == "python"]
    exec(compile(code, "docs/verl.md", "exec"), {})
    for m in modules:
        cls = m.MegatronCheckpointManager
        assert cls.__name__ == "CkptdMegatronCheckpointManager", m.__name__
        assert cls._ckptd_base.__module__ == MODULES[0]  # a subclass of verl's own class


def test_own_daemon_lines(tmp_path: Path) -> None:
    """The socket line prints socket_for(ROOT); the serve line is what the CLI accepts at that socket."""
    lines = [ln.split("#")[0].strip() for ln in _bash("ckptd serve").splitlines()]
    root = str(tmp_path / "ckptd" / "actor")
    script = "\n".join([f"ROOT={shlex.quote(root)}", lines[1].replace("python ", f"{sys.executable} ", 1),
                        'echo "$SOCKET"'])
    out = subprocess.run(["bash", "-ec", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    socket = out.stdout.strip()
    assert socket == socket_for(root) and socket.endswith(".sock")
    argv = shlex.split(lines[2].rstrip("&").replace('"$ROOT"', root).replace('"$SOCKET"', socket))
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.root, args.socket) == ("serve", root, socket)


@pytest.mark.parametrize("command", ["merge", "demo"])
def test_ckptd_command_lines(command: str) -> None:
    (line,) = [ln for ln in _bash(f"ckptd {command}").splitlines() if ln.startswith(f"ckptd {command}")]
    args = build_parser().parse_args(shlex.split(line)[1:])  # SystemExit on an unknown flag or a bad value
    assert args.command == command
    if command == "demo":
        assert args.trainer == "verl"
    else:
        assert args.step == "4" and args.root.endswith("/ckptd/actor")  # a role root, $CKPTD_ROOT/<role>
