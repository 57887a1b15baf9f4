"""``ckptd demo --trainer verl``: a verl-managed save and resume, for real, on one machine.

verl's own ``MegatronCheckpointManager`` (verl 0.9, the ``ckptd[verl]`` extra), switched to ckptd by the
Ray setup hook ``ckptd.integrations.verl.install``, around a real megatron-core GPT and distributed
optimizer per role (actor and critic) on ``ranks`` gloo ranks (default 2; CPU shim without a GPU), one
``ckptd serve`` per role root:

1. job 1 trains ``steps`` steps (default 4) and saves every ``save_every`` (default 2: ``global_step_2``
   and ``global_step_4``) as verl's trainer does (sync mode: each step committed when ``save_checkpoint``
   returns; then the trainer writes its tracker);
2. job 2, fresh processes with another init: verl's ``find_latest_ckpt_path`` reads the tracker (the last
   save of job 1: the resume point), each role's ``load_checkpoint(global_step_N/<role>)`` restores model,
   optimizer and LR scheduler, compared bit for bit with job 1's live state at that save; it trains
   ``save_every`` more steps and saves ``global_step_{N+save_every}`` in async mode, whose tracker verl's
   finalize writes once the step committed.

Every rank is a data-parallel rank (TP1: the toy model is built without tensor parallelism).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from ckptd.writer.errors import ConfigError

ARENA = "64MiB"
RANKS, STEPS, SAVE_EVERY = 2, 4, 2  # the defaults: job 1 saves steps 2 and 4 (sync), job 2 saves step 6 (async)


class VerlDemoPlan(NamedTuple):
    """What the demo runs: ``ranks`` DP ranks; job 1 trains ``steps`` steps and saves ``saves`` (sync); job 2
    resumes from ``saves[-1]`` and saves ``async_step`` (async)."""

    ranks: int
    steps: int
    save_every: int
    saves: tuple[int, ...]
    async_step: int
    global_microbatches: int

    @property
    def resume(self) -> int:
        """The step job 2 resumes from: job 1's last save."""
        return self.saves[-1]


def plan_verl_demo(ranks: int | None = None, steps: int | None = None, save_every: int | None = None) -> VerlDemoPlan:
    """The demo's plan for the CLI's ``--ranks/--steps/--save-every`` (None: this demo's default); raise
    :class:`ConfigError` for values it cannot run."""
    ranks = RANKS if ranks is None else ranks
    steps = STEPS if steps is None else steps
    save_every = SAVE_EVERY if save_every is None else save_every
    if ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {ranks}")
    if save_every < 1 or steps < save_every:
        raise ConfigError(f"need --steps >= --save-every >= 1 (got {steps} and {save_every}): "
                          "job 1 must save at least once for job 2 to resume from")
    saves = tuple(range(save_every, steps + 1, save_every))
    # the toy model's 4 micro-batches per step, rounded up to a multiple of DP (= ranks)
    return VerlDemoPlan(ranks, steps, save_every, saves, saves[-1] + save_every, ranks * -(-4 // ranks))


def require_verl() -> None:
    """Raise :class:`ConfigError` naming the extra when verl or megatron-core does not import."""
    try:  # verl's Megatron manager imports megatron-core itself; their import-time notes (no GPU, no Apex, no
        # Transformer Engine, engines not installed) are not the demo's business
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)  # verl sets its loggers' levels itself as it imports them
            import verl.utils.checkpoint.megatron_checkpoint_manager  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"`ckptd demo --trainer verl` needs verl 0.9 and megatron-core ({exc}): pip install ckptd[verl]"
        ) from exc
    finally:
        logging.disable(logging.NOTSET)


# --- ranks (module level: run in forked rank processes) ----------------------------------------------
def _quiet(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Swallow what verl prints to stdout (its save prints the whole TransformerConfig)."""

    @functools.wraps(fn)
    def run(*args: Any) -> dict[str, Any]:
        with contextlib.redirect_stdout(io.StringIO()):
            return fn(*args)

    return run


@_quiet
def _first_job(rank: int, world: int, ckpt_dir: str, plan: VerlDemoPlan) -> dict[str, Any]:
    import torch

    from ckptd.integrations.verl import ckptd_root
    from ckptd.testing.verl_job import HOOK, TRACKER, build_managers, committed, snapshot, train

    managers = build_managers(HOOK, 0, async_save=False, global_microbatches=plan.global_microbatches)
    saves = []
    snaps: dict[str, Any] = {}
    for it in range(plan.steps):
        train(managers, it, 1)
        step = it + 1
        if step not in plan.saves:
            continue
        for role, r in managers.items():
            local = os.path.join(ckpt_dir, f"global_step_{step}", role)
            t0 = time.perf_counter()
            r.manager.save_checkpoint(local, None, step, max_ckpt_to_keep=2)
            saves.append({"role": role, "step": step, "save_s": time.perf_counter() - t0,
                          "committed_at_return": step in committed(ckptd_root(local, role))})
        torch.distributed.barrier()
        if rank == 0:  # sync mode: verl's trainer writes the tracker right after save_checkpoint returned
            with open(os.path.join(ckpt_dir, TRACKER), "w") as f:
                f.write(str(step))
        torch.distributed.barrier()
        snaps = {role: snapshot(r.manager) for role, r in managers.items()}  # what a resume from here restores
    return {"saves": saves, "snaps": snaps, "cls": type(managers["actor"].manager).__name__}


@_quiet
def _second_job(rank: int, world: int, ckpt_dir: str, plan: VerlDemoPlan) -> dict[str, Any]:
    import torch
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    from ckptd.testing.verl_job import HOOK, TRACKER, build_managers, snapshot, train

    folder = find_latest_ckpt_path(ckpt_dir)  # type: ignore[no-untyped-call]  # verl's resume_mode=auto
    # another init: the load must replace it all
    managers = build_managers(HOOK, 4321, async_save=True, global_microbatches=plan.global_microbatches)
    train(managers, 0, 1, sched_too=False)  # and live optimizer state
    t0 = time.perf_counter()
    for role, r in managers.items():
        r.manager.load_checkpoint(os.path.join(folder, role), None, False)
    load_s = time.perf_counter() - t0
    snaps = {role: snapshot(r.manager) for role, r in managers.items()}
    step = plan.async_step
    train(managers, plan.resume, plan.save_every)
    for role, r in managers.items():
        r.manager.save_checkpoint(os.path.join(ckpt_dir, f"global_step_{step}", role), None, step, max_ckpt_to_keep=2)
    for r in managers.values():
        r.manager.finalize_pending(blocking=True)  # what the next save or process exit would do
    torch.distributed.barrier()
    with open(os.path.join(ckpt_dir, TRACKER)) as f:
        tracker = f.read()
    return {"folder": folder, "snaps": snaps, "load_s": load_s, "tracker_after_async": tracker}


# --- the parent ----------------------------------------------------------------------------------
def run_verl_demo(
    root: str | None, as_json: bool, ranks: int | None = None, steps: int | None = None, save_every: int | None = None,
) -> int:
    """Run the verl demo in ``root`` (verl's ``trainer.default_local_dir``) on ``ranks`` ranks, job 1 training
    ``steps`` steps and saving every ``save_every`` (None: 2, 4, 2); 0 when the resume is bit-exact and every
    step committed and was tracked in order, 1 otherwise."""
    plan = plan_verl_demo(ranks, steps, save_every)
    require_verl()
    from ckptd.integrations.verl import ckptd_root, socket_for
    from ckptd.testing.demo import _prepare_root
    from ckptd.testing.launch import DaemonProcess, run_ranks
    from ckptd.testing.verl_job import PRELOAD, ROLES, committed, same

    ckpt_dir = os.path.abspath(root or "ckptd-demo-verl")
    _prepare_root(ckpt_dir)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # megatron-core's and verl's import-time warnings
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")  # verl's per-rank INFO lines (the forkserver inherits)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckptd-verl-") as private:
        os.chmod(private, 0o700)
        # what the ranks see: roots under the checkpoint dir, daemon sockets in a private directory
        env = {"CKPTD_ROOT": os.path.join(ckpt_dir, "ckptd"), "XDG_RUNTIME_DIR": private,
               "CKPTD_DAEMON_ARGS": f"--arena-size {ARENA} --no-prefault"}
        roots = {role: ckptd_root(os.path.join(ckpt_dir, "global_step_0", role), role, env) for role in ROLES}
        daemons = [DaemonProcess(r, socket_for(r, env), "--arena-size", ARENA, "--no-prefault",
                                 log_path=os.path.join(private, f"{role}.log")) for role, r in roots.items()]
        try:
            for d in daemons:
                d.wait_ready(120)
            first = run_ranks(_first_job, plan.ranks, ckpt_dir, plan, env=env, preload=PRELOAD, launcher="ray",
                              timeout_s=600)
            second = run_ranks(_second_job, plan.ranks, ckpt_dir, plan, env=env, preload=PRELOAD, launcher="ray",
                               timeout_s=600)
        except BaseException:
            for d in daemons:
                print(d.log_tail(), file=sys.stderr)
            raise
        finally:
            for d in daemons:
                d.stop(60)
    checked, mismatches = 0, []
    for rank, (a, b) in enumerate(zip(first, second, strict=True)):
        try:
            checked += same(a["snaps"], b["snaps"], f"rank {rank}")
        except AssertionError as exc:
            mismatches.append(str(exc))
    resumed = second[0]["folder"]
    result = {
        "checkpoint_dir": ckpt_dir,
        "ranks": plan.ranks,
        "steps": plan.steps,
        "save_every": plan.save_every,
        "manager": first[0]["cls"],
        "roles": {role: {"root": r, "committed_steps": committed(r)} for role, r in roots.items()},
        "saves": [{k: v for k, v in s.items()} for s in first[0]["saves"]],
        "committed_at_return": all(s["committed_at_return"] for f in first for s in f["saves"]),
        "resumed_from": os.path.basename(resumed) if resumed else None,
        "resume": "bit-exact" if checked and not mismatches else "mismatch",
        "tensors_checked": checked,
        "mismatches": mismatches,
        "load_s": max(s["load_s"] for s in second),
        "async_step": plan.async_step,
        "tracker_after_async_save": second[0]["tracker_after_async"],
        "seconds": round(time.perf_counter() - t_start, 2),
    }
    kept = [plan.resume, plan.async_step]  # max_ckpt_to_keep=2
    ok = (result["resume"] == "bit-exact" and result["committed_at_return"]
          and result["resumed_from"] == f"global_step_{plan.resume}"
          and result["tracker_after_async_save"] == str(plan.async_step)
          and all(v["committed_steps"] == kept for v in result["roles"].values()))
    if as_json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0 if ok else 1


def _print(r: dict[str, Any]) -> None:
    print(f"ckptd demo --trainer verl: {r['ranks']} gloo ranks, verl's {r['manager']} (through the Ray setup hook), "
          "actor and critic, megatron-core GPT + DistributedOptimizer")
    print(f"checkpoint dir: {r['checkpoint_dir']}")
    print()
    print(f"job 1 ({r['steps']} steps, sync save every {r['save_every']}):")
    for s in r["saves"]:
        state = "committed" if s["committed_at_return"] else "NOT committed"
        print(f"  global_step_{s['step']}/{s['role']:<7} save_checkpoint {s['save_s'] * 1e3:7.1f}ms, {state} on return")
    print(f"job 2 (fresh processes): find_latest_ckpt_path -> {r['resumed_from']}; load_checkpoint: {r['resume']} "
          f"({r['tensors_checked']} model/optimizer/scheduler tensors compared, {r['load_s']:.2f}s)")
    for m in r["mismatches"]:
        print(f"  differs: {m}")
    print(f"  async save of global_step_{r['async_step']}: tracker now {r['tracker_after_async_save']} "
          "(written after the commit)")
    for role, v in r["roles"].items():
        print(f"{role:>7} root {v['root']}: committed steps {v['committed_steps']} (max_ckpt_to_keep=2)")
    print(f"total {r['seconds']:.1f}s")
