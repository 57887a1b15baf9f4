"""``assume_constant_structure=True``: the Megatron save reads the state tensors it captured, behind a cheap
whole-structure check, and waits for no answer from the daemon.

Real daemon process, two gloo ranks, the toy GPT (multi-bucket buffer) on the CPU shim. Saves with values
changed by training in between go through the captured state (the capture is not renewed: the fast path
ran) and each step reloads bit-exact (model tensors, main params, Adam states, the per-param ``step``, the
param groups' learning rate). Then structure changes the promise rules out but the cheap check catches —
a new param group, a param replaced by another tensor — are saved through the checked path (planned
again) and reload bit-exact too; the old plan, with the re-homed states it staged from, is freed before
the new plan re-homes them again (a pipelined save held it until its answer was read).
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from test_save_plan import BUILD, _assert_same, _live, _param

from ckptd.client import CheckpointClient
from ckptd.client.megatron import load_checkpoint, save_checkpoint
from ckptd.client.megatron import save as save_module
from ckptd.client.megatron.layout import rank_plan
from ckptd.client.megatron.staged import cached
from ckptd.testing.toy_gpt import build_gpt, spawn_with_daemon

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


def _saves(rank: int, world: int, socket: str, root: str) -> dict[str, Any]:
    client = CheckpointClient(socket, assume_constant_structure=True)
    model, optimizer, train_step = build_gpt(**BUILD)
    twin, twin_optimizer, twin_step = build_gpt(**BUILD, initialize_parallel=False)  # never saved
    train_step(0)
    twin_step(0)
    saved: list[tuple[int, str, dict[str, Any]]] = []
    handles = []
    fast: dict[str, bool] = {}

    def save(tag: str, keep: bool = True) -> None:
        step = len(fast) + 1
        frozen = getattr(cached(optimizer), "frozen", None)
        handle = save_checkpoint(client, step, model, optimizer, extra={"tag": tag})
        staged = cached(optimizer)
        assert staged is not None
        fast[tag] = frozen is not None and staged.frozen is frozen  # read what an earlier save captured
        if keep:  # reloaded and compared by verify()
            saved.append((step, tag, _live(model, optimizer)))
        handles.append(handle)

    def verify() -> None:  # every save so far commits and reloads bit-exact (a load drops the capture)
        for h in handles:
            h.wait(60)
        while saved:
            step, tag, at_save = saved.pop(0)
            load_checkpoint(root, step, model, optimizer)
            _assert_same(at_save, _live(model, optimizer), f"rank{rank} {tag}")
        handles.clear()

    inner = optimizer.chained_optimizers[0].optimizer
    torch_allocated = [(v, k, weakref.ref(v[k])) for v in inner.state.values()
                       for k in ("exp_avg", "exp_avg_sq", "step")]
    save("first")  # re-homes the optimizer's states: one flat tensor per (bucket slice, state), one `step` tensor
    # no second copy of the states stays: each tensor torch allocated is freed, or is still the state (a slice
    # that one param fills is its own flat tensor)
    fast["freed"] = all(r() is None or r() is v[k] for v, k, r in torch_allocated)
    homed = {name: {v[name].untyped_storage().data_ptr() for v in inner.state.values()}
             for name in ("exp_avg", "exp_avg_sq", "step")}
    for i in range(1, 3):  # values change in place (params, states, step, lr): the capture holds
        for opt, train in ((optimizer, train_step), (twin_optimizer, twin_step)):
            train(i)
            for g in opt.chained_optimizers[0].optimizer.param_groups:
                g["lr"] = 1e-3 * (i + 1)
        save(f"trained{i}")
    # Adam stepped the re-homed states in place, and trained exactly as the twin whose states torch allocated
    _assert_same(_live(model, optimizer), _live(twin, twin_optimizer), f"rank{rank} re-homed vs twin")
    binding = rank_plan(optimizer).binding
    assert binding is not None
    buckets = sum(1 for entries in binding.owned.values() if entries)
    fast["homed"] = {k: len(v) for k, v in homed.items()} == {"exp_avg": buckets, "exp_avg_sq": buckets, "step": 1}
    fast["twin_separate"] = len({v["exp_avg"].untyped_storage().data_ptr()
                                 for v in twin_optimizer.chained_optimizers[0].optimizer.state.values()}) > 2
    verify()
    save("reloaded", keep=False)  # the load replaced the step tensors: checked, captured again
    # a new param group: caught, saved through the check
    inner.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.5, "weight_decay": 0.0})
    # planned again: the old plan and the re-homed states it staged from are freed before re-homing allocates
    # anew (the last pipelined save held the plan for a resend until its answer was read)
    old_plan = weakref.ref(cached(optimizer).plan)  # type: ignore[union-attr]
    rehome = save_module.rehome_states

    def rehome_after_free(*args: Any) -> Any:
        gc.collect()
        fast["old_plan_freed"] = old_plan() is None
        return rehome(*args)

    save_module.rehome_states = rehome_after_free
    try:
        save("group")
    finally:
        save_module.rehome_states = rehome
    train_step(3)
    save("after_group")
    verify()
    save("reloaded_again", keep=False)
    with torch.no_grad():  # a param replaced by another tensor: caught by its address
        p = _param(model, "layers.0.self_attention.linear_proj.bias")
        p.data = p.data.clone() + 0.25
    save("replaced")
    verify()
    client.close()
    return fast


def test_constant_structure_saves_reload_bit_exact_and_structure_changes_are_caught(
    tmp_path: Path, module_sockdir: str
) -> None:
    root = str(tmp_path / "root")
    results = spawn_with_daemon(_saves, 2, root, os.path.join(module_sockdir, "const.sock"),
                                log_path=str(tmp_path / "daemon.log"))
    for fast in results:
        assert fast == {
            "first": False, "trained1": True, "trained2": True, "reloaded": False, "group": False,
            "after_group": True, "reloaded_again": False, "replaced": False, "homed": True, "twin_separate": True,
            "freed": True, "old_plan_freed": True,
        }, fast
