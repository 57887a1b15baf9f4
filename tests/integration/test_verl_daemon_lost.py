"""A verl save lost with its daemon never gets verl's resume files.

One rank runs verl's real ``MegatronCheckpointManager`` (switched by the install hook) around a real
megatron-core GPT, with the embedded daemon the integration starts. A step's daemon is SIGKILLed right
after the step was staged and before it committed: in sync mode ``save_checkpoint`` raises, so the trainer
writes no ``latest_checkpointed_iteration.txt`` for it; in async mode ``finalize_pending`` raises it once and
verl's finalize (``ckpt_contents.json``, the tracker, verl's retention) never runs for it. The next save
(the client has started a new embedded daemon on finding its daemon gone) commits as usual. No sleep stands
for synchronisation: the daemon is stopped (SIGSTOP) before the commit marker is looked at, so the step
committed before that or never.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("verl.utils.checkpoint.megatron_checkpoint_manager")

from ckptd.integrations.verl import ckptd_root
from ckptd.testing.daemon_kill import kill_after_staging, socket_refuses
from ckptd.testing.fixtures import wait_for
from ckptd.testing.launch import run_ranks
from ckptd.testing.verl_job import HOOK, PRELOAD, TRACKER, build_managers, committed, train
from ckptd.writer.errors import DaemonUnavailableError

pytestmark = [pytest.mark.megatron, pytest.mark.verl, pytest.mark.timeout(300)]

ROLE = {"actor": 1234}


def _files(ckpt_dir: str, step: int) -> dict[str, Any]:
    """What verl's resume sees after ``step``: the tracker, the manifests, the folders, the committed steps."""
    tracker = Path(ckpt_dir, TRACKER)
    return {
        "tracker": tracker.read_text() if tracker.exists() else None,
        "manifests": sorted(p.parent.parent.name for p in Path(ckpt_dir).glob("global_step_*/actor/ckpt_contents.*")),
        "folders": sorted(p.name for p in Path(ckpt_dir).glob("global_step_*")),
        "committed": committed(ckptd_root(os.path.join(ckpt_dir, f"global_step_{step}", "actor"), "actor")),
    }


def _lost_job(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """Sync mode (the trainer writes the tracker when save_checkpoint returns), then async mode (verl's
    finalize writes it): in each, one good step, one whose daemon is killed, one more good step."""
    from verl.workers.config.checkpoint import McoreCheckpointConfig

    import ckptd.client.megatron as cm

    managers = build_managers(HOOK, 0, async_save=False, roles=ROLE)
    mgr = managers["actor"].manager
    out: dict[str, Any] = {}
    step = 0

    def save(async_mode: bool, kill: bool) -> tuple[int, str | None]:
        """One save as the trainer makes it: (its step, the class name of what it raised, or None)."""
        nonlocal step
        caught: dict[int, bool] = {}
        killed: list[int] = []
        while True:
            step += 2
            train(managers, step, 1)
            if kill:
                kill_after_staging(cm, caught, killed)
            try:
                mgr.save_checkpoint(os.path.join(ckpt_dir, f"global_step_{step}", "actor"), None, step,
                                    max_ckpt_to_keep=1)
                if async_mode:
                    mgr.finalize_pending(blocking=True)  # the step's finalize, or its error
                elif rank == 0:  # the trainer, once save_checkpoint returned
                    Path(ckpt_dir, TRACKER).write_text(str(step))
                error = None
            except DaemonUnavailableError as exc:
                error = type(exc).__name__
            if not kill or caught.get(step):
                break
            assert error is None, error  # the race was lost (committed before the stop): a normal step
        if killed:  # the next save must not find the dead daemon's socket still accepting for a moment
            client = mgr._ckptd_client
            wait_for(lambda: socket_refuses(client.socket_path) or client._welcome.daemon_pid != killed[0],
                     "the killed daemon's socket to refuse, or a new daemon to serve")
        return step, error

    for async_mode in (False, True):
        if async_mode:
            mgr.checkpoint_config = McoreCheckpointConfig(async_save=True)
        good, err = save(async_mode, kill=False)
        assert err is None, err
        lost, err = save(async_mode, kill=True)
        out[async_mode] = {"good": good, "lost": lost, "error": err, "after_lost": _files(ckpt_dir, lost),
                           "pending": len(mgr._ckptd_pending)}
        again, err = save(async_mode, kill=False)  # a new daemon, and training goes on
        out[async_mode].update(again=again, again_error=err, after_again=_files(ckpt_dir, again))
    return out


@pytest.fixture
def ray_env(sockdir: str) -> Any:
    """The env the rank sees (embedded daemons with a small arena, their sockets in ``sockdir``); at the
    end, any daemon still serving there is ended."""
    env = {"XDG_RUNTIME_DIR": sockdir, "CKPTD_DAEMON_ARGS": "--arena-size 64MiB --no-prefault"}
    yield env
    left = [p for p in psutil.process_iter(["cmdline"])
            if "serve" in (p.info["cmdline"] or []) and any(sockdir in a for a in p.info["cmdline"] or [])]
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):  # it may have exited by itself since it was listed
            p.terminate()
    psutil.wait_procs(left, timeout=20)


def test_a_step_lost_with_its_daemon_gets_no_resume_files(tmp_path: Path, ray_env: dict[str, str]) -> None:
    ckpt_dir = str(tmp_path / "checkpoints")
    got = run_ranks(_lost_job, 1, ckpt_dir, env=ray_env, preload=PRELOAD, timeout_s=240)[0]
    for async_mode in (False, True):
        r = got[async_mode]
        good, lost, again = r["good"], r["lost"], r["again"]
        # the lost step raised (sync: from save_checkpoint, so the trainer wrote nothing; async: from
        # finalize_pending, once), and no resume file names it
        assert r["error"] == "DaemonUnavailableError", r
        after = r["after_lost"]
        assert after["tracker"] == str(good), after
        assert f"global_step_{lost}" not in after["manifests"], after
        assert f"global_step_{good}" in after["folders"], after  # verl's retention did not run for it
        assert lost not in after["committed"] and good in after["committed"], after
        assert r["pending"] == 0  # raised once, not again at the next save
        # the next save starts a new daemon and commits; its files are written as usual
        assert r["again_error"] is None
        assert r["after_again"]["tracker"] == str(again)
        assert f"global_step_{again}" in r["after_again"]["manifests"]
        assert again in r["after_again"]["committed"]
