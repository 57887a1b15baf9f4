"""ckptd under the real verl 0.9 package: its MegatronCheckpointManager, switched by the install hook.

Each rank runs what verl's Megatron engine runs: the setup hook (``ckptd.integrations.verl.install``, what
Ray's ``worker_process_setup_hook`` calls), then ``MegatronCheckpointManager(...)`` looked up in
``verl.workers.engine.megatron.transformer_impl`` with the engine's arguments, around a real
megatron-core GPT and distributed optimizer on 2 gloo ranks (CPU shim), for an actor and a critic in the
same job. Saves go through ``manager.save_checkpoint(global_step_N/<role>, ...)`` as the trainer calls
it; a fresh set of processes finds the step with verl's own ``find_latest_ckpt_path`` and loads it with
``manager.load_checkpoint``; model, optimizer and LR scheduler must equal the live state at save, bit
for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl.utils.checkpoint.megatron_checkpoint_manager")

from ckptd.integrations.verl import ckptd_root, placement_from_env, socket_for, step_of
from ckptd.testing.launch import DaemonProcess, run_ranks
from ckptd.testing.verl_job import (
    HOOK,
    PRELOAD,
    ROLES,
    build_managers,
    committed,
    hf_files,
    same,
    snapshot,
    train,
    write_hf_model,
)
from ckptd.writer.errors import CkptdError

pytestmark = [pytest.mark.megatron, pytest.mark.verl]


# --- what the rank runs (module level: forked rank processes) ----------------------------------------
def _save_job(rank: int, world: int, ckpt_dir: str, hook: str) -> dict[str, Any]:
    """A sync-mode job: save actor and critic at steps 2 and 4 with max_ckpt_to_keep=1, as the trainer does."""
    managers = build_managers(hook, 0, async_save=False)
    tracker = os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt")
    committed_at_return = {}
    for step in (2, 4):
        train(managers, step - 2, 2)
        for role, (mgr, _, _) in managers.items():
            local = os.path.join(ckpt_dir, f"global_step_{step}", role)
            mgr.save_checkpoint(local, None, step, max_ckpt_to_keep=1)
            # sync mode: when save_checkpoint returns, the trainer writes the tracker at once
            committed_at_return[(role, step)] = step in committed(ckptd_root(local, role))
        torch.distributed.barrier()
        if rank == 0:
            with open(tracker, "w") as f:
                f.write(str(step))
        torch.distributed.barrier()
    snaps = {role: snapshot(mgr) for role, (mgr, _, _) in managers.items()}
    # step 6 commits, then the job dies before the trainer writes the tracker: resume must take step 4
    train(managers, 4, 2)
    for role, (mgr, _, _) in managers.items():
        mgr.save_checkpoint(os.path.join(ckpt_dir, "global_step_6", role), None, 6, max_ckpt_to_keep=2)
    return {"snaps": snaps, "committed_at_return": committed_at_return,
            "placement": placement_from_env(), "cls": type(managers["actor"][0]).__name__}


def _resume_job(rank: int, world: int, ckpt_dir: str, hook: str) -> dict[str, Any]:
    """Fresh processes: verl's resume lookup, the manager's load; then go on in async mode (step 6)."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    folder = find_latest_ckpt_path(ckpt_dir)  # what ray_trainer._load_checkpoint does for resume_mode=auto
    managers = build_managers(hook, 4321, async_save=True)  # another init: the load must replace every value
    train(managers, 0, 1, sched_too=False)  # and live optimizer state (Megatron's scheduler load adds up)
    for role, (mgr, _, _) in managers.items():
        mgr.load_checkpoint(os.path.join(folder, role), None, False)
    snaps = {role: snapshot(mgr) for role, (mgr, _, _) in managers.items()}

    train(managers, 4, 2)
    tracker = os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt")
    finalized: list[tuple[str, bool]] = []  # (role, committed when verl's finalize ran)
    for role, (mgr, _, _) in managers.items():
        # verl's finalize lambda looks the method up when it runs, so this sees every finalize: the one
        # at dispatch (if the step committed that fast) and the ones finalize_pending runs later
        def counted(*a: Any, _inner: Any = mgr._finalize_save, _role: str = role, **kw: Any) -> Any:
            finalized.append((_role, 6 in committed(ckptd_root(kw["local_path"], _role))))
            return _inner(*a, **kw)

        mgr._finalize_save = counted
    for role, (mgr, _, _) in managers.items():  # step 6 again: the dead run's step 6 is replaced
        mgr.save_checkpoint(os.path.join(ckpt_dir, "global_step_6", role), None, 6, max_ckpt_to_keep=2)
    # async mode: the trainer does not write the tracker; the manager's finalize does, once committed
    for mgr, _, _ in managers.values():
        mgr.finalize_pending(blocking=True)
        assert not mgr._ckptd_pending
    torch.distributed.barrier()
    with open(tracker) as f:
        after_async = f.read()
    return {"folder": folder, "snaps": snaps, "finalized": finalized, "tracker_after_async": after_async,
            "committed": {role: committed(ckptd_root(os.path.join(ckpt_dir, "x", role), role)) for role in ROLES}}


HF_ROLE = {"actor": 1234}


def _hf_save_job(rank: int, world: int, ckpt_dir: str, hf_dir: str) -> dict[str, Any]:
    """verl's default model mode (HF weights through the bridge): a full save at step 2, then a model-only
    one (save_contents without the optimizer) at step 4."""
    if rank == 0:
        write_hf_model(hf_dir)  # the HF model the run starts from (model.path)
    torch.distributed.barrier()
    managers = build_managers(HOOK, 0, async_save=False, roles=HF_ROLE, hf_dir=hf_dir)
    mgr = managers["actor"].manager
    train(managers, 0, 2)
    mgr.save_checkpoint(os.path.join(ckpt_dir, "global_step_2", "actor"), None, 2)
    snap2 = snapshot(mgr)
    train(managers, 2, 2)
    mgr.checkpoint_save_contents = ["model", "extra"]
    mgr.save_checkpoint(os.path.join(ckpt_dir, "global_step_4", "actor"), None, 4)
    # Megatron shards for the model slot plus an HF export (use_dist_checkpointing: True, hf_model)
    mgr.use_dist_checkpointing, mgr.checkpoint_save_contents = True, ["model", "hf_model"]
    mgr.save_checkpoint(os.path.join(ckpt_dir, "global_step_6", "actor"), None, 6)
    return {"snap2": snap2, "snap4": snapshot(mgr)}


def _hf_load_job(rank: int, world: int, ckpt_dir: str, hf_dir: str) -> dict[str, Any]:
    """Fresh processes load what the HF-mode job saved, under several ``load_contents``."""
    managers = build_managers(HOOK, 4321, async_save=False, roles=HF_ROLE, hf_dir=hf_dir)
    train(managers, 0, 1, sched_too=False)  # live optimizer state, to be replaced or kept
    mgr = managers["actor"].manager
    step2, step4 = (os.path.join(ckpt_dir, f"global_step_{n}", "actor") for n in (2, 4))
    out: dict[str, Any] = {"errors": []}
    for name, contents, path in (("hf", ["hf_model"], step2), ("full", ["model", "optimizer", "extra"], step2),
                                 ("model_only", ["model"], step4), (None, ["optimizer"], step2),
                                 (None, ["model", "optimizer"], step4)):
        mgr.checkpoint_load_contents = contents
        if name == "full":  # the HF load just before left step 2's weights: the model must be read again
            with torch.no_grad():
                for chunk in mgr.model:
                    for p in chunk.parameters():
                        p.fill_(-3.25)
        try:
            mgr.load_checkpoint(path, None, False)
        except CkptdError as exc:
            out["errors"].append((contents, type(exc).__name__, str(exc)))
        if name:
            out[name] = snapshot(mgr)
    return out


@pytest.fixture
def verl_job(tmp_path: Path, sockdir: str) -> Any:
    """A checkpoint dir, the env the ranks see, and ``ckptd serve`` per role root at the socket the
    integration derives from that root. ``stop()`` ends them; the next job's first rank per role then starts
    its own (the embedded default), which the fixture ends at teardown, found by its socket."""
    ckpt_dir = str(tmp_path / "checkpoints")
    env = {"CKPTD_SOCKET": os.path.join(sockdir, "default.sock"),
           "CKPTD_DAEMON_ARGS": "--arena-size 64MiB --no-prefault"}
    roots = [ckptd_root(os.path.join(ckpt_dir, "global_step_0", role), role, env) for role in ROLES]
    daemons: list[DaemonProcess] = []
    for role, root in zip(ROLES, roots, strict=True):
        d = DaemonProcess(root, socket_for(root, env), "--arena-size", "64MiB", "--no-prefault",
                          log_path=str(tmp_path / f"{role}.log"))
        daemons.append(d.wait_ready())

    def stop() -> None:
        for d in daemons:
            assert d.stop(timeout=20) == 0, d.log_tail()
        daemons.clear()

    yield ckpt_dir, env, stop
    stop()
    embedded = _serving({socket_for(root, env) for root in roots})
    for p in embedded:  # started by the ranks of this test (start_new_session: not our children)
        with contextlib.suppress(psutil.NoSuchProcess):  # it may have exited by itself since it was listed
            p.terminate()
    psutil.wait_procs(embedded, timeout=20)


def _serving(sockets: set[str]) -> list[psutil.Process]:
    """The ``ckptd serve`` processes listening at these sockets."""
    return [p for p in psutil.process_iter(["cmdline"])
            if "serve" in (p.info["cmdline"] or []) and sockets & set(p.info["cmdline"] or [])]


def _documented_hook() -> str:
    """The switch as docs/verl.md gives it (the Hydra override of verl's ray_kwargs.ray_init.runtime_env)."""
    doc = (Path(__file__).parents[2] / "docs" / "verl.md").read_text()
    found = re.findall(r"\+ray_kwargs\.ray_init\.runtime_env\.worker_process_setup_hook=(\S+)", doc)
    assert found, "docs/verl.md lost its switch"
    return str(found[0])


def test_verl_manager_save_resume(verl_job: Any) -> None:
    ckpt_dir, env, stop_daemons = verl_job
    hook = _documented_hook()
    saved = run_ranks(_save_job, 2, ckpt_dir, hook, env=env, preload=PRELOAD, timeout_s=300)
    assert saved[0]["cls"] == "CkptdMegatronCheckpointManager"
    assert [r["placement"].rank for r in saved] == [0, 1]
    # sync mode: the step had committed when save_checkpoint returned (the trainer writes the tracker then)
    assert all(all(r["committed_at_return"].values()) for r in saved), [r["committed_at_return"] for r in saved]

    for role in ROLES:
        step_dir = Path(ckpt_dir, "global_step_4", role)
        manifest = json.loads((step_dir / "ckpt_contents.json").read_text())
        assert manifest["ckptd"] == {"root": ckptd_root(str(step_dir), role), "step": 4}
        assert manifest["contents"]["optimizer"]["format"] == "ckptd"
        assert manifest["contents"]["model"]["format"] == "ckptd"
        assert (step_dir / "transformer_config.json").is_file()  # verl's own files are kept
        written = sorted(str(f.relative_to(step_dir)) for f in step_dir.rglob("*") if f.is_file())
        assert written == ["ckpt_contents.json", "transformer_config.json"], written  # no dist_ckpt files
        assert not Path(ckpt_dir, "global_step_2", role).exists()  # verl's retention (max_ckpt_to_keep=1)
        assert committed(ckptd_root(str(step_dir), role)) == [4, 6]  # ckptd's retention, per role root
    assert Path(ckpt_dir, "latest_checkpointed_iteration.txt").read_text() == "4"  # step 6 never got it
    stop_daemons()  # a new job: the first rank per role starts a daemon (the old ones remember step 6)

    resumed = run_ranks(_resume_job, 2, ckpt_dir, hook, env=env, preload=PRELOAD, timeout_s=300)
    for rank, (s, r) in enumerate(zip(saved, resumed, strict=True)):
        assert r["folder"] == os.path.join(ckpt_dir, "global_step_4")
        assert step_of(os.path.join(r["folder"], "actor")) == 4
        checked = same(s["snaps"], r["snaps"], f"rank{rank}")
        assert checked > 20, checked
        # actor and critic are different models: a collision would have loaded one into the other
        assert not torch.equal(s["snaps"]["actor"]["model"]["embedding.word_embeddings.weight"],
                               s["snaps"]["critic"]["model"]["embedding.word_embeddings.weight"])
    # actor and critic async saves finalized once each, each after its commit
    assert sorted(resumed[0]["finalized"]) == [("actor", True), ("critic", True)], resumed[0]["finalized"]
    assert resumed[0]["tracker_after_async"] == "6"
    assert resumed[0]["committed"] == {"actor": [4, 6], "critic": [4, 6]}
    roots = [ckptd_root(os.path.join(ckpt_dir, "x", role), role) for role in ROLES]
    assert len(_serving({socket_for(root, env) for root in roots})) == 2  # one embedded daemon per role


def test_documented_switch_reaches_ray_init() -> None:
    """The Hydra overrides docs/verl.md gives compose with verl's own trainer config, and main_ppo's merge
    of ``ray_kwargs.ray_init.runtime_env`` hands Ray the hook and the environment."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer import config as verl_config
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    doc = (Path(__file__).parents[2] / "docs" / "verl.md").read_text()
    overrides = re.findall(r"(\+ray_kwargs\.ray_init\.runtime_env\.[\w.]+=[^\s`]+)", doc)
    assert len(overrides) >= 2, overrides  # the switch and the CKPTD_ROOT example
    with initialize_config_dir(config_dir=os.path.dirname(verl_config.__file__), version_base=None):
        cfg = compose(config_name="ppo_megatron_trainer", overrides=overrides)
    # what verl/trainer/main_ppo.py does before ray.init(**ray_init_kwargs)
    runtime_env = OmegaConf.to_container(
        OmegaConf.merge(get_ppo_ray_runtime_env(cfg), cfg.ray_kwargs.get("ray_init", {}).get("runtime_env", {}))
    )
    assert isinstance(runtime_env, dict)
    assert runtime_env["worker_process_setup_hook"] == _documented_hook() == "ckptd.integrations.verl.install"
    assert runtime_env["env_vars"]["CKPTD_ROOT"].startswith("s3://")
    assert "TOKENIZERS_PARALLELISM" in runtime_env["env_vars"]  # verl's own defaults survive the merge


def test_verl_hf_mode(verl_job: Any, tmp_path: Path) -> None:
    """verl's default model mode (``use_dist_checkpointing: False``): verl's own code writes the HF weights
    (mbridge), config and tokenizer; ckptd holds the model shards, optimizer and RNG; ``save_contents``
    and ``load_contents`` pick what is saved and loaded."""
    ckpt_dir, env, _ = verl_job
    hf_dir = str(tmp_path / "hf_init")
    saved = run_ranks(_hf_save_job, 2, ckpt_dir, hf_dir, env=env, preload=PRELOAD, timeout_s=300)
    step2 = Path(ckpt_dir, "global_step_2", "actor")
    hf = hf_files(str(step2 / "model" / "huggingface"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(hf), hf
    files = [f for f in hf_files(str(step2)) if not f.startswith("model/huggingface/")]
    assert files == ["ckpt_contents.json", "transformer_config.json"], files  # nothing in dist_ckpt/
    manifest = json.loads((step2 / "ckpt_contents.json").read_text())
    contents = manifest["contents"]
    assert contents["model"]["format"] == "huggingface" and contents["tokenizer"]["format"] == "huggingface"
    assert contents["hf_config"]["path"] == "model/huggingface"
    held = ("model_shards", "optimizer", "lr_scheduler", "rng_state")
    assert {k: contents[k]["format"] for k in held} == dict.fromkeys(held, "ckptd")
    manifest4 = json.loads(Path(ckpt_dir, "global_step_4", "actor", "ckpt_contents.json").read_text())
    assert "optimizer" not in manifest4["contents"] and manifest4["contents"]["model_shards"]["format"] == "ckptd"
    assert (Path(ckpt_dir, "global_step_4", "actor", "model", "huggingface", "model.safetensors")).is_file()
    contents6 = json.loads(Path(ckpt_dir, "global_step_6", "actor", "ckpt_contents.json").read_text())["contents"]
    assert {k: v["format"] for k, v in contents6.items()} == {
        "model": "ckptd", "hf_model": "huggingface", "hf_config": "huggingface", "tokenizer": "huggingface"}
    assert Path(ckpt_dir, "global_step_6", "actor", "model", "huggingface", "model.safetensors").is_file()

    loaded = run_ranks(_hf_load_job, 2, ckpt_dir, hf_dir, env=env, preload=PRELOAD, timeout_s=300)
    for rank, (s, r) in enumerate(zip(saved, loaded, strict=True)):
        assert same(s["snap2"]["model"], r["hf"]["model"], f"rank{rank}/hf") > 10  # verl's HF weights, exact
        assert same(s["snap2"], r["full"], f"rank{rank}/full") > 20  # ckptd: shards, optimizer, scheduler
        assert same(s["snap4"]["model"], r["model_only"]["model"], f"rank{rank}/model_only") > 10
        # the optimizer was not loaded: its states stay (fp32 main params are views of the loaded weights)
        moments = [{n: ({k: t for k, t in ts.items() if k != "param"}) for n, (_, ts) in snap["optim"].items()}
                   for snap in (r["full"], r["model_only"])]
        assert same(*moments, f"rank{rank}/optimizer kept") > 10
        assert [(c, t) for c, t, _ in r["errors"]] == [
            (["optimizer"], "InvalidRequestError"), (["model", "optimizer"], "CheckpointNotFoundError")]
        assert "add 'model'" in r["errors"][0][2] and "holds no optimizer" in r["errors"][1][2]
