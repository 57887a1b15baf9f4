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

pytestmark = [pytest.mark.megatron, pytest.mark.verl]

ROLES = {"actor": 1234, "critic": 999}  # role -> model seed (two different models in one job)
PRELOAD = ["verl.utils.checkpoint.megatron_checkpoint_manager", "verl.workers.engine.megatron.transformer_impl"]


# --- what the rank runs (module level: forked rank processes) ----------------------------------------
def _managers(hook: str, seed_offset: int, async_save: bool) -> dict[str, Any]:
    """Actor and critic as verl's Megatron engine builds them, after Ray ran the setup hook ``hook``."""
    from ray._private.runtime_env.setup_hook import load_and_execute_setup_hook

    from ckptd.testing.toy_gpt import build_gpt

    error = load_and_execute_setup_hook(hook)  # what a Ray worker does with runtime_env's hook string
    assert error is None, error
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.utils import unwrap_model
    from omegaconf import OmegaConf
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.engine.megatron import transformer_impl

    cls = transformer_impl.MegatronCheckpointManager  # the name the engine looks up
    out = {}
    for i, (role, seed) in enumerate(ROLES.items()):
        model, optimizer, train_step = build_gpt(seed=seed + seed_offset, data_seed=seed, initialize_parallel=i == 0)
        sched = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=10, lr_decay_steps=20,  # warmup only
            lr_decay_style="linear", start_wd=0.01, end_wd=0.01, wd_incr_steps=20, wd_incr_style="constant",
        )
        tmp_config = OmegaConf.create({"model": {"path": "unused"}, "megatron": {
            "dist_ckpt_optim_fully_reshardable": False, "distrib_optim_fully_reshardable_mem_efficient": False}})
        mgr = cls(  # the keyword arguments of verl/workers/engine/megatron/transformer_impl.py
            config=tmp_config, checkpoint_config=CheckpointConfig(async_save=async_save), model_config=None,
            transformer_config=unwrap_model(model[0]).config, role=role, model=model, arch="GPTModel",
            hf_config=None, param_dtype=torch.float32, share_embeddings_and_output_weights=True,
            processing_class=None, optimizer=optimizer, optimizer_scheduler=sched, use_distributed_optimizer=True,
            use_checkpoint_opt_param_scheduler=True, use_dist_checkpointing=True, bridge=None, provider=None,
            peft_cls=None, use_megatron_fsdp=False,
        )
        out[role] = (mgr, train_step, sched)
    return out


def _train(managers: dict[str, Any], start: int, n: int, sched_too: bool = True) -> None:
    for _, train_step, sched in managers.values():
        for it in range(start, start + n):
            train_step(it)
            if sched_too:
                sched.step(1)


def _snapshot(mgr: Any) -> dict[str, Any]:
    from megatron.core.utils import unwrap_model

    from ckptd.testing.fixtures import megatron_owned_state

    model = {k: v.detach().clone() for k, v in unwrap_model(mgr.model[0]).state_dict().items()
             if isinstance(v, torch.Tensor)}
    optim = {e["name"]: (e["range"], {k: t.clone() for k, t in e["tensors"].items()})
             for e in megatron_owned_state(mgr.optimizer)}
    return {"model": model, "optim": optim, "sched": mgr.lr_scheduler.state_dict()}


def _committed(root: str) -> list[int]:
    from ckptd.writer.root import open_root
    from ckptd.writer.sync import run_sync

    async def run() -> list[int]:
        async with open_root(root) as ckpt:
            return sorted(await ckpt.committed_steps())

    return run_sync(run())


def _save_job(rank: int, world: int, ckpt_dir: str, hook: str) -> dict[str, Any]:
    """A sync-mode job: save actor and critic at steps 2 and 4 with max_ckpt_to_keep=1, as the trainer does."""
    managers = _managers(hook, 0, async_save=False)
    tracker = os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt")
    committed_at_return = {}
    for step in (2, 4):
        _train(managers, step - 2, 2)
        for role, (mgr, _, _) in managers.items():
            local = os.path.join(ckpt_dir, f"global_step_{step}", role)
            mgr.save_checkpoint(local, None, step, max_ckpt_to_keep=1)
            # sync mode: when save_checkpoint returns, the trainer writes the tracker at once
            committed_at_return[(role, step)] = step in _committed(ckptd_root(local, role))
        torch.distributed.barrier()
        if rank == 0:
            with open(tracker, "w") as f:
                f.write(str(step))
        torch.distributed.barrier()
    snaps = {role: _snapshot(mgr) for role, (mgr, _, _) in managers.items()}
    # step 6 commits, then the job dies before the trainer writes the tracker: resume must take step 4
    _train(managers, 4, 2)
    for role, (mgr, _, _) in managers.items():
        mgr.save_checkpoint(os.path.join(ckpt_dir, "global_step_6", role), None, 6, max_ckpt_to_keep=2)
    return {"snaps": snaps, "committed_at_return": committed_at_return,
            "placement": placement_from_env(), "cls": type(managers["actor"][0]).__name__}


def _resume_job(rank: int, world: int, ckpt_dir: str, hook: str) -> dict[str, Any]:
    """Fresh processes: verl's resume lookup, the manager's load; then go on in async mode (step 6)."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    folder = find_latest_ckpt_path(ckpt_dir)  # what ray_trainer._load_checkpoint does for resume_mode=auto
    managers = _managers(hook, 4321, async_save=True)  # another init: the load must replace every value
    _train(managers, 0, 1, sched_too=False)  # and live optimizer state (Megatron's scheduler load adds up)
    for role, (mgr, _, _) in managers.items():
        mgr.load_checkpoint(os.path.join(folder, role), None, False)
    snaps = {role: _snapshot(mgr) for role, (mgr, _, _) in managers.items()}

    _train(managers, 4, 2)
    tracker = os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt")
    finalized: list[tuple[str, bool]] = []  # (role, committed when verl's finalize ran)
    for role, (mgr, _, _) in managers.items():
        # verl's finalize lambda looks the method up when it runs, so this sees every finalize: the one
        # at dispatch (if the step committed that fast) and the ones finalize_pending runs later
        def counted(*a: Any, _inner: Any = mgr._finalize_save, _role: str = role, **kw: Any) -> Any:
            finalized.append((_role, 6 in _committed(ckptd_root(kw["local_path"], _role))))
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
            "committed": {role: _committed(ckptd_root(os.path.join(ckpt_dir, "x", role), role)) for role in ROLES}}


# --- comparison ----------------------------------------------------------------------------------------
def _same(a: Any, b: Any, where: str) -> int:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{where} differs"
        return 1
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} vs {sorted(b)}"
        return sum(_same(a[k], b[k], f"{where}/{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        return sum(_same(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True)))
    assert a == b, f"{where}: {a!r} vs {b!r}"
    return 0


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
        assert _committed(ckptd_root(str(step_dir), role)) == [4, 6]  # ckptd's retention, per role root
    assert Path(ckpt_dir, "latest_checkpointed_iteration.txt").read_text() == "4"  # step 6 never got it
    stop_daemons()  # a new job: the first rank per role starts a daemon (the old ones remember step 6)

    resumed = run_ranks(_resume_job, 2, ckpt_dir, hook, env=env, preload=PRELOAD, timeout_s=300)
    for rank, (s, r) in enumerate(zip(saved, resumed, strict=True)):
        assert r["folder"] == os.path.join(ckpt_dir, "global_step_4")
        assert step_of(os.path.join(r["folder"], "actor")) == 4
        checked = _same(s["snaps"], r["snaps"], f"rank{rank}")
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
