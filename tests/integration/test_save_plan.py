"""A registered save plan is reused while the structure holds and replaced the moment it changes.

Real daemon process, two gloo ranks, the toy GPT (multi-bucket buffer) on the CPU shim. One client saves
through a sequence of structure changes — an optimizer state replaced by the user's own tensor (the plan
stages the flat tensor the states were re-homed into: the lookup's address check catches it), a model param
replaced by another tensor, a param cast to
another dtype, a new param group in the optimizer, another model whose buckets are sized differently —
and after every save the live state is scrambled and the step loaded back into it: every model tensor,
main param, optimizer state and param group must equal the state at save time, bit for bit. A stale plan
would save the old tensor's bytes (or the old dtype) and fail the comparison. Each save after the first
starts copying the old plan's static sources before its checks (:mod:`ckptd.client.early`): the changes
throw that copy away, and the test checks they did. Rank 0 makes that copy on a worker thread while its checks
run (as a rank with a core to spare does), rank 1 on its own thread before them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient, staging
from ckptd.client.megatron import load_checkpoint, save_checkpoint
from ckptd.client.megatron.staged import cached
from ckptd.testing.toy_gpt import build_gpt, spawn_with_daemon
from ckptd.writer.errors import StepCommittedError

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]

BUILD = {"overlap_grad_reduce": True, "bucket_size": 6000}


def _live(model: list[torch.nn.Module], optimizer: Any) -> dict[str, Any]:
    from megatron.core.utils import unwrap_model

    out: dict[str, Any] = {
        f"model/{k}": v.detach().clone()
        for k, v in unwrap_model(model[0]).state_dict().items() if isinstance(v, torch.Tensor)
    }
    for oi, opt in enumerate(optimizer.chained_optimizers):
        inner = opt.optimizer
        out[f"{oi}/groups"] = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        for gi, go in opt.model_param_group_index_map.values():
            main = inner.param_groups[gi]["params"][go]
            out[f"{oi}/{gi}.{go}/main"] = main.detach().clone()
            for k, v in inner.state.get(main, {}).items():
                out[f"{oi}/{gi}.{go}/{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def _assert_same(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    assert a.keys() == b.keys(), f"{where}: {sorted(a.keys() ^ b.keys())[:5]}"
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{where} {k}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{where} {k}"
        else:
            assert x == y, f"{where} {k}: {x!r} vs {y!r}"


def _scramble(model: list[torch.nn.Module], optimizer: Any) -> None:
    with torch.no_grad():
        for c in model:
            for p in c.parameters():
                p.add_(0.5)
        for opt in optimizer.chained_optimizers:
            for g in opt.optimizer.param_groups:
                g["lr"] = 0.123
                for p in g["params"]:
                    for v in opt.optimizer.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor):
                            v.add_(1.0)


def _param(model: list[torch.nn.Module], suffix: str) -> torch.nn.Parameter:
    from megatron.core.utils import unwrap_model

    return next(p for n, p in unwrap_model(model[0]).named_parameters() if n.endswith(suffix))


def _params(model: list[torch.nn.Module], suffix: str) -> list[torch.nn.Parameter]:
    from megatron.core.utils import unwrap_model

    return [p for n, p in unwrap_model(model[0]).named_parameters() if n.endswith(suffix)]


def _changes(rank: int, world: int, socket: str, root: str) -> dict[str, Any]:
    client = CheckpointClient(socket)
    if rank == 0 and not torch.cuda.is_available():  # copies its static sources on a worker thread while its
        staging.THREADED_STATIC_BYTES = 0  # checks run, as a rank with a core to spare does; rank 1 before them
        client._staging.threaded = True
    model, optimizer, train_step = build_gpt(**BUILD)
    train_step(0)
    step = 0
    plans: dict[str, Any] = {}
    attempts: dict[str, str] = {}

    early: dict[str, str] = {}

    def save_and_reload(tag: str) -> None:
        nonlocal step
        step += 1
        before = dict(client._pipe.early)
        handle = save_checkpoint(client, step, model, optimizer, extra={"tag": tag})
        attempts[tag] = handle.attempt
        # whether the plan's static copies started ahead of the checks were kept ("used") or thrown away
        early[tag] = ",".join(sorted(k for k, n in client._pipe.early.items() if n != before.get(k, 0)))
        at_save = _live(model, optimizer)
        staged = cached(optimizer)
        assert staged is not None
        plans[tag] = (staged.plan, staged.plan.registered[1] if staged.plan.registered else 0)
        _scramble(model, optimizer)  # the daemon drains while the live tensors change
        handle.wait(60)
        load_checkpoint(root, step, model, optimizer)
        _assert_same(at_save, _live(model, optimizer), f"rank{rank} {tag}")

    save_and_reload("first")
    train_step(1)  # values change in place: the plan holds
    save_and_reload("same")
    inner = optimizer.chained_optimizers[0].optimizer  # a re-homed state replaced by the user's own tensor:
    if rank == 0:  # caught by its address (the plan stages the flat tensor); on one rank: it alone replans,
        state = inner.state[next(iter(inner.state))]  # within its save call, in the attempt its peer saves in
        state["exp_avg"] = state["exp_avg"].clone() + 0.5
    save_and_reload("state_replaced")
    with torch.no_grad():  # a param replaced by another tensor (its old storage stays in the grad buffer)
        p = _param(model, "layers.0.self_attention.linear_proj.bias")
        p.data = p.data.clone() + 0.25
    save_and_reload("replaced")
    save_and_reload("replaced_again")
    with torch.no_grad():  # another dtype (every layer's: they are one stacked array)
        for q in _params(model, "mlp.linear_fc2.bias"):
            q.data = q.data.double() + 0.125
    save_and_reload("dtype")
    device = next(model[0].parameters()).device
    inner.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device=device))], "lr": 0.5,
                           "weight_decay": 0.0})
    save_and_reload("group")
    # the step announced to the daemon with the copy made ahead, and refused there (committed already): the
    # save raises the typed error and gives the lease back; the next save leases as usual
    before = dict(client._pipe.early)
    with pytest.raises(StepCommittedError):
        save_checkpoint(client, step, model, optimizer)
    early["committed_again"] = ",".join(sorted(k for k, n in client._pipe.early.items() if n != before.get(k, 0)))
    old_plan = plans["group"][0]
    model, optimizer, train_step = build_gpt(overlap_grad_reduce=True, bucket_size=3000)  # resized buckets
    train_step(0)
    save_and_reload("buckets")
    worker = client._staging._worker is not None
    client.close()
    out = {tag: (id(plan), pid, len(plan.metas)) for tag, (plan, pid) in plans.items()}
    out["old_plan_keys"] = sorted(m.key for m in old_plan.metas)
    out["new_plan_keys"] = sorted(m.key for m in plans["buckets"][0].metas)
    out["attempts"] = attempts
    out["early"] = early
    out["worker"] = worker
    return out


def test_structure_changes_replan_and_every_save_reloads_bit_exact(tmp_path: Path, module_sockdir: str) -> None:
    root = str(tmp_path / "root")
    results = spawn_with_daemon(_changes, 2, root, os.path.join(module_sockdir, "plan.sock"),
                                log_path=str(tmp_path / "daemon.log"))
    # each save is the first attempt at its step on both ranks, rank 0's replan included
    assert results[0]["attempts"] == results[1]["attempts"], results
    assert all(a.endswith(".1") for a in results[0]["attempts"].values()), results[0]["attempts"]
    assert results[1]["state_replaced"] == results[1]["same"]  # rank 1's state was not replaced
    # the plan's static sources are copied ahead of the checks into the lease granted with the previous save;
    # a structure change (or a state the lookup no longer finds at its address) throws that copy away, gives the
    # lease back and saves through a new plan: the bit-exact reloads above are of those saves
    for r, replaced in zip(results, ("abandoned", "used"), strict=True):
        assert r["early"] == {
            "first": "", "same": "used", "state_replaced": replaced, "replaced": "abandoned",
            "replaced_again": "used", "dtype": "abandoned", "group": "abandoned", "committed_again": "used",
            "buckets": "",
        }, r["early"]
    assert [r["worker"] for r in results] == [True, False]  # rank 0's static copies ran beside its checks
    for r in results:
        # unchanged structure: the same plan object, registered once (same id)
        assert r["first"] == r["same"], r
        assert r["replaced"] == r["replaced_again"], r
        # every structure change planned (and registered) anew
        changes = ("first", "state_replaced", "replaced", "dtype", "group", "buckets")
        ids = [r[t][1] for t in changes if r is results[0] or t != "state_replaced"]
        assert len(set(ids)) == len(ids) and all(ids), ids
        assert r["old_plan_keys"] != r["new_plan_keys"]  # other bucket keys
        assert any("bucket1/" in k for k in r["new_plan_keys"])


@pytest.mark.gpu
def test_on_a_gpu_the_copies_queued_ahead_are_thrown_away_on_a_change(start_daemon: Any, tmp_path: Path) -> None:
    """The same sequence on one NCCL rank with the model and optimizer on the GPU: there the static copies are
    D2H transfers queued before the checks and still moving while they run; a change waits for them and gives
    the lease back, and every save reloads bit-exact."""
    from ckptd.testing.launch import run_ranks

    assert torch.cuda.is_available()
    d = start_daemon(str(tmp_path / "root"), arena="256MiB")
    [r] = run_ranks(_changes, 1, d.socket, d.root, timeout_s=300, backend="nccl")
    assert r["early"] == {
        "first": "", "same": "used", "state_replaced": "abandoned", "replaced": "abandoned",
        "replaced_again": "used", "dtype": "abandoned", "group": "abandoned", "committed_again": "used",
        "buckets": "",
    }, r["early"]


def _moved_away_and_back(rank: int, world: int, socket: str, root: str, constant: bool) -> dict[str, Any]:
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    client = CheckpointClient(socket, assume_constant_structure=constant)
    if rank == 0 and not torch.cuda.is_available():  # the copy made ahead on a worker thread, as in _changes
        staging.THREADED_STATIC_BYTES = 0
        client._staging.threaded = True
    model, optimizer, train_step = build_gpt(**BUILD, bf16=True)  # bf16: main params with memory of their own
    train_step(0)
    save_checkpoint(client, 1, model, optimizer).wait(60)
    if constant:  # the promise captures what it reads at the save after the planning one
        train_step(1)
        save_checkpoint(client, 2, model, optimizer).wait(60)
    first = cached(optimizer)
    opts = optimizer.chained_optimizers
    mains = [p for opt in opts for group in opt.shard_fp32_from_float16_groups for p in group]
    states = [v for opt in opts for v in opt.optimizer.state.values()]

    def move() -> None:  # what moving the optimizer to the host or back does (verl's optimizer offload):
        with torch.no_grad():  # every state tensor replaced by a copy, every main param given new memory
            for v in states:
                for k in ("exp_avg", "exp_avg_sq"):
                    v[k] = v[k].clone()
            for p in mains:
                p.data = p.data.clone()

    watched = [StorageWeakRef(v[k].untyped_storage()) for v in states for k in ("exp_avg", "exp_avg_sq")]
    watched += [StorageWeakRef(p.untyped_storage()) for p in mains]
    move()
    gc.collect()
    freed = sum(w.expired() for w in watched)
    move()  # and back
    rehomed = []  # after each save: whether states were made views of a flat tensor (re-homed; a bucket slice
    # with a single param's state keeps that tensor: it is the slice's flat tensor already)
    for step in (3, 4):  # the save after a move plans again; after the second, without re-homing
        train_step(step - 1)
        handle = save_checkpoint(client, step, model, optimizer)
        rehomed.append(any(v["exp_avg"]._base is not None for v in states))
        at_save = _live(model, optimizer)
        replanned = cached(optimizer) is not first
        first = cached(optimizer)
        _scramble(model, optimizer)
        handle.wait(60)
        load_checkpoint(root, step, model, optimizer)
        _assert_same(at_save, _live(model, optimizer), f"rank{rank} moved, step {step}")
        states = [v for opt in opts for v in opt.optimizer.state.values()]
        move()
        move()
    client.close()
    return {"freed": freed, "watched": len(watched), "mains": len(mains), "replanned": replanned, "rehomed": rehomed}


@pytest.mark.parametrize("constant", [False, True], ids=["checked", "promise"])
def test_an_optimizer_moved_away_and_back_is_not_kept_alive_by_the_plan(
    tmp_path: Path, module_sockdir: str, constant: bool
) -> None:
    """A trainer that moves its optimizer off the device between saves (verl's optimizer offload) replaces
    every state tensor and gives every main param new memory. The cached plan must not keep the old copies
    alive until the next save (a second copy of the optimizer's memory); that save plans again and reloads
    bit-exact — under ``assume_constant_structure`` too, whose cheap guard does not look at the states'
    addresses: it would have staged the old copies."""
    root = str(tmp_path / "root")
    results = spawn_with_daemon(_moved_away_and_back, 2, root, os.path.join(module_sockdir, "moved.sock"), constant)
    for r in results:
        assert r["mains"] > 0 and r["freed"] == r["watched"], r  # every old state and main param copy freed
        assert r["replanned"], r
        # a plan whose re-homed states were let go within one save of it is followed by plans that do not
        # re-home them (that would copy every state once more at each save, for a plan the next move makes
        # stale); under the promise the first plan served two saves before the move, so the next one re-homes
        assert r["rehomed"] == [constant, False], r


def _copied(rank: int, world: int, socket: str, root: str) -> dict[str, Any]:
    """A model whose ``sharded_state_dict()`` hands out a copy of a param (as megatron-core's legacy
    ``GroupedMLP`` does for its experts' weights): a plan reads its sources at every save, so it would store
    the copy's first values forever, and a load cannot write into a copy. Both saves refuse it, typed."""
    from megatron.core.utils import unwrap_model

    from ckptd.writer.errors import InvalidRequestError

    client = CheckpointClient(socket)
    model, optimizer, train_step = build_gpt(**BUILD)
    train_step(0)
    module = unwrap_model(model[0])
    made = module.sharded_state_dict

    def with_a_copy(*args: Any, **kwargs: Any) -> Any:
        sd = made(*args, **kwargs)
        key = next(k for k in sd if k.endswith("final_layernorm.weight"))
        sd[key].data = sd[key].data.clone()  # memory of its own: no param's or buffer's
        return sd

    module.sharded_state_dict = with_a_copy
    refused = []
    for opt in (optimizer, None):  # with the optimizer, and the model alone
        with pytest.raises(InvalidRequestError, match=r"copies, not views of a param or buffer \(model/decoder"):
            save_checkpoint(client, 1, model, opt)
        refused.append(cached(optimizer) is None)
    del module.sharded_state_dict  # the model's own again: saved and reloaded bit-exact
    handle = save_checkpoint(client, 1, model, optimizer)
    at_save = _live(model, optimizer)
    handle.wait(60)
    _scramble(model, optimizer)
    load_checkpoint(root, 1, model, optimizer)
    _assert_same(at_save, _live(model, optimizer), f"rank{rank}")
    client.close()
    return {"refused": refused}


def test_a_model_tensor_that_is_a_copy_is_refused_at_save(tmp_path: Path, module_sockdir: str) -> None:
    root = str(tmp_path / "root")
    results = spawn_with_daemon(_copied, 2, root, os.path.join(module_sockdir, "copied.sock"),
                                log_path=str(tmp_path / "daemon.log"))
    assert results == [{"refused": [True, True]}] * 2, results
