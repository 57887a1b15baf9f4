"""The README's training-loop example runs as written (root pointed at a temporary directory)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs(tmp_path, sockdir, monkeypatch):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)  # type: ignore[union-attr]
    code = code.replace('"/checkpoints/run1"', repr(str(tmp_path / "run1")))
    monkeypatch.setenv("CKPTD_SOCKET", os.path.join(sockdir, "readme.sock"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    scope: dict[str, object] = {"train_one_step": lambda: None}
    try:
        exec(compile(code, str(README), "exec"), scope)
        restored, w = scope["restored"], scope["w"]
        assert isinstance(restored, dict) and restored["step"] == 1000
        template = scope["template"]
        assert torch.equal(template["model/w"].data, w)  # type: ignore[index]
        steps = sorted(int(p.name[5:]) for p in (tmp_path / "run1").iterdir() if p.name.startswith("step_"))
        assert steps == list(range(100, 1001, 100))
    finally:
        client = scope.get("client")
        if client is not None:
            os.kill(client._welcome.daemon_pid, signal.SIGTERM)  # type: ignore[attr-defined]
