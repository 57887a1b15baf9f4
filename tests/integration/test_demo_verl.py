"""``ckptd demo --trainer verl``: verl's checkpoint manager through ckptd's hook, save and resume, as users run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.daemon.cli import main


def test_demo_verl_without_the_extra_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without verl, ``--trainer verl`` fails before touching anything and names the extra to install."""
    monkeypatch.setitem(sys.modules, "verl.utils.checkpoint.megatron_checkpoint_manager", None)  # not importable
    root = tmp_path / "demo"
    assert main(["demo", "--trainer", "verl", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and "pip install ckptd[verl]" in err, err
    assert not root.exists()


@pytest.mark.slow  # ~60 s: two jobs of 2 ranks, actor and critic, with verl imported in each
@pytest.mark.megatron
@pytest.mark.verl
def test_demo_verl_json(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    pytest.importorskip("verl.utils.checkpoint.megatron_checkpoint_manager")
    root = tmp_path / "verl-demo"
    cmd = [sys.executable, "-m", "ckptd.daemon.cli", "demo", "--trainer", "verl", "--json", "--root", str(root)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])  # stdout holds nothing but the JSON line
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout[:2000]
    assert out["manager"] == "CkptdMegatronCheckpointManager"
    assert [(s["role"], s["step"]) for s in out["saves"]] == [
        ("actor", 2), ("critic", 2), ("actor", 4), ("critic", 4)]
    assert out["committed_at_return"] is True
    assert out["resumed_from"] == "global_step_4"
    assert out["resume"] == "bit-exact" and out["tensors_checked"] > 100 and not out["mismatches"]
    assert out["tracker_after_async_save"] == "6"
    assert {role: v["committed_steps"] for role, v in out["roles"].items()} == {"actor": [4, 6], "critic": [4, 6]}
    assert out["roles"]["actor"]["root"] == str(root / "ckptd" / "actor")
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert json.loads((root / "global_step_6" / "critic" / "ckpt_contents.json").read_text())["ckptd"]["step"] == 6
