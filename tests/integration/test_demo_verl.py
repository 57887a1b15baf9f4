"""``ckptd demo --trainer verl``: verl's checkpoint manager through ckptd's hook, save and resume, as users run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.daemon.cli import main
from ckptd.testing.demo_verl import VerlDemoPlan, plan_verl_demo


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


def test_demo_verl_flags_set_ranks_saves_and_resume() -> None:
    """``--ranks/--steps/--save-every`` (None: not given) plan the run: job 1's saves, the resume, job 2's save."""
    assert plan_verl_demo() == VerlDemoPlan(ranks=2, steps=4, save_every=2, saves=(2, 4), async_step=6,
                                            global_microbatches=4)
    plan = plan_verl_demo(3, 7, 3)  # step 7 is trained after the last save and lost, as in a crash
    assert (plan.saves, plan.resume, plan.async_step, plan.global_microbatches) == ((3, 6), 6, 9, 6)
    assert plan_verl_demo(1, 1, 1)[3:] == ((1,), 2, 4)


@pytest.mark.parametrize(("flags", "says"), [
    (["--ranks", "0"], "--ranks must be >= 1, got 0"),
    (["--steps", "1"], "need --steps >= --save-every >= 1 (got 1 and 2)"),
    (["--save-every", "0"], "need --steps >= --save-every >= 1 (got 4 and 0)"),
])
def test_demo_verl_refuses_flags_it_cannot_run(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value the verl demo cannot run is a ConfigError (exit 2) before anything starts, not ignored."""
    root = tmp_path / "demo"
    assert main(["demo", "--trainer", "verl", "--root", str(root), *flags]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and says in err, err
    assert not root.exists()


@pytest.mark.slow  # 40-100 s (idle to loaded): two jobs of 3 ranks, actor and critic, with verl imported in each
@pytest.mark.megatron
@pytest.mark.verl
def test_demo_verl_json(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    pytest.importorskip("verl.utils.checkpoint.megatron_checkpoint_manager")
    root = tmp_path / "verl-demo"
    # 3 DP ranks; job 1 saves steps 2 and 4 and trains step 5 (lost); job 2 resumes from 4 and saves 6
    cmd = [sys.executable, "-m", "ckptd.daemon.cli", "demo", "--trainer", "verl", "--json", "--root", str(root),
           "--ranks", "3", "--steps", "5", "--save-every", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])  # stdout holds nothing but the JSON line
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout[:2000]
    assert out["manager"] == "CkptdMegatronCheckpointManager"
    assert (out["ranks"], out["steps"], out["save_every"], out["async_step"]) == (3, 5, 2, 6)
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
