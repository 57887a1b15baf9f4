"""Scalar per-param optimizer state (torch Adam's ``step``) saved with different values on different ranks.

One rule on every load path: at the saved layout (same TP/PP, buckets and DP size) each rank restores its own
saved rank's values; a load that maps the state onto another layout (another DP size; another TP, read straight
from the DP bucket slices or from the merged layout) takes the one value every saved rank holds, and refuses
with ``LayoutMismatchError`` naming the state and the ranks when they differ, before anything is written. Real
megatron-core ranks on CPU (gloo), the toy GPT: saved at TP1 DP2, step 2 with the ranks agreeing (the
control), step 3 after rank 1's ``step`` was moved on by one.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.megatron

TRAINED = 2.0  # Adam's step after the two training steps


def _steps(optimizer: Any) -> list[float]:
    """Every value of Adam's ``step`` the optimizer holds, sorted and deduplicated."""
    return sorted({float(state["step"]) for opt in optimizer.chained_optimizers
                   for state in opt.optimizer.state.values() if "step" in state})


def _save(rank: int, world: int, socket: str, root: str) -> list[float]:
    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import save_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(tp=1)
    for i in range(2):
        train_step(i)
    client = CheckpointClient(socket)
    save_checkpoint(client, 2, model, optimizer).wait(60)
    if rank == 1:  # as if this DP rank's params had taken one step more
        for opt in optimizer.chained_optimizers:
            for state in opt.optimizer.state.values():
                state["step"].add_(1)
    save_checkpoint(client, 3, model, optimizer).wait(60)
    return _steps(optimizer)


def _load(rank: int, world: int, root: str, tp: int, merge: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from ckptd.client.megatron import load_checkpoint
    from ckptd.testing.toy_gpt import build_gpt
    from ckptd.writer.errors import LayoutMismatchError

    model, optimizer, _train_step = build_gpt(tp=tp, seed=999)

    def each() -> dict[int, Any]:
        out: dict[int, Any] = {}
        for step in (2, 3):
            before = _steps(optimizer)
            try:
                loaded = load_checkpoint(root, step, model, optimizer)
            except LayoutMismatchError as exc:
                out[step] = {"err": str(exc), "untouched": _steps(optimizer) == before}
            else:
                out[step] = {"layout": loaded.layout, "steps": _steps(optimizer)}
        return out

    result = {"plain": each()}
    if merge:  # the same loads from the merged layout
        from ckptd.writer.merge import merge as run_merge

        dist.barrier()
        if rank == 0:
            for step in (2, 3):
                run_merge(root, step, progress=False)
        dist.barrier()
        result["merged"] = each()
    return result


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ckptd.testing.toy_gpt import spawn_with_daemon

    tmp = tmp_path_factory.mktemp("scalars")
    root = str(tmp / "root")
    steps = spawn_with_daemon(_save, 2, root, str(tmp / "d.sock"), log_path=str(tmp / "daemon.log"))
    assert steps == [[TRAINED], [TRAINED + 1]], steps
    return root


def _refused(out: dict[str, Any]) -> None:
    assert "err" in out, f"loaded at another layout although the ranks' Adam step differs: {out}"
    assert "scalar optimizer state 'step'" in out["err"], out["err"]
    assert f"{TRAINED!r} on rank 0; {TRAINED + 1!r} on rank 1" in out["err"], out["err"]
    assert out["untouched"], "the refused load changed the optimizer's step"


def test_same_layout_restores_each_ranks_own_values(saved: str) -> None:
    from ckptd.testing.toy_gpt import spawn_ranks

    r0, r1 = (r["plain"] for r in spawn_ranks(_load, 2, saved, 1, False))
    assert r0[2] == r1[2] == {"layout": "saved", "steps": [TRAINED]}, (r0, r1)
    assert r0[3] == {"layout": "saved", "steps": [TRAINED]}, r0
    assert r1[3] == {"layout": "saved", "steps": [TRAINED + 1]}, r1  # its own saved rank's, not rank 0's


def test_another_dp_size_refuses_differing_values(saved: str) -> None:
    from ckptd.testing.toy_gpt import spawn_ranks

    (out,) = (r["plain"] for r in spawn_ranks(_load, 1, saved, 1, False))
    assert out[2] == {"layout": "saved", "steps": [TRAINED]}, out  # the control: the ranks agree
    _refused(out[3])


def test_another_tp_refuses_differing_values_resharded_and_merged(saved: str) -> None:
    from ckptd.testing.toy_gpt import spawn_ranks

    for r in spawn_ranks(_load, 2, saved, 2, True):
        assert {path: r[path][2] for path in r} == {"plain": {"layout": "resharded", "steps": [TRAINED]},
                                                    "merged": {"layout": "merged", "steps": [TRAINED]}}, r
        assert all("err" in r[path][3] for path in r), r  # both paths, not one: the rule is the same
        for path in r:
            _refused(r[path][3])


def test_message_names_every_value_and_rank() -> None:
    from ckptd.client.megatron.checks import uniform_scalars
    from ckptd.writer.errors import LayoutMismatchError, StateMismatchError

    def meta(spec: dict[str, Any]) -> dict[str, Any]:
        return {"layout_version": 1, "optimizers": {"0": {"param_groups": [{"lr": 0.1}], "scalar_state": {"k": spec}}}}

    agree = {0: meta({"dtype": "int64", "value": 7}), 1: meta({"dtype": "int64", "by_param": {"a": 7, "b": 7}})}
    out = uniform_scalars(5, agree, 1)
    assert out["optimizers"]["0"]["scalar_state"] == {"k": {"dtype": "int64", "value": 7}}
    assert out["optimizers"]["0"]["param_groups"] == [{"lr": 0.1}]
    differ = {0: meta({"dtype": "int64", "value": 7}), 1: meta({"dtype": "int64", "by_param": {"a": 7, "b": 8}}),
              2: meta({"dtype": "float32", "value": 7})}
    with pytest.raises(StateMismatchError) as err:
        uniform_scalars(5, differ, 0)
    assert isinstance(err.value, LayoutMismatchError)
    assert "'k' of optimizer 0" in str(err.value), err.value
    assert "7 (int64) on ranks 0, 1; 8 (int64) on rank 1; 7 (float32) on rank 2" in str(err.value), err.value
