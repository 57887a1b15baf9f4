"""A grad scaler the live optimizer cannot take from the checkpoint (saved with a constant loss scale, loaded
with a dynamic one) is refused with StateMismatchError before anything is written: it is restored last, so
before the check the model, the main params and the optimizer's moments were already overwritten when its
``load_state_dict`` raised KeyError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.megatron


def _save(rank: int, world: int, socket: str) -> bool:
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler

    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import save_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, step = build_gpt(bf16=True)
    for i in range(2):
        step(i)
    for o in optimizer.chained_optimizers:
        o.grad_scaler = ConstantGradScaler(1.0)
    save_checkpoint(CheckpointClient(socket), 2, model, optimizer).wait(60)
    return True


def _load(rank: int, world: int, root: str) -> dict[str, Any]:
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    from ckptd.client.megatron import load_checkpoint
    from ckptd.testing.toy_gpt import build_gpt
    from ckptd.writer.errors import StateMismatchError

    model, optimizer, _step = build_gpt(bf16=True, seed=999)
    for o in optimizer.chained_optimizers:
        o.grad_scaler = DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0,
                                          backoff_factor=0.5, growth_interval=1000, hysteresis=2)
    p = next(model[0].parameters())
    before = p.detach().clone()
    inner = optimizer.chained_optimizers[0].optimizer
    main = inner.param_groups[0]["params"][0]
    main_before = main.detach().clone()
    try:
        load_checkpoint(root, 2, model, optimizer)
        err = ""
    except StateMismatchError as exc:
        err = str(exc)
    return {"err": err, "model_changed": not torch.equal(before, p.detach()),
            "main_changed": not torch.equal(main_before, main.detach()),
            "moments": "exp_avg" in inner.state.get(main, {})}


def test_a_grad_scaler_it_cannot_take_is_refused_before_anything_is_written(start_daemon, tmp_path: Path) -> None:
    from ckptd.testing.toy_gpt import spawn_ranks

    root = str(tmp_path / "root")
    d = start_daemon(root)
    assert spawn_ranks(_save, 1, d.socket) == [True]
    (out,) = spawn_ranks(_load, 1, root)
    assert "needs ['" in out["err"] and "saved with another loss scaling" in out["err"], out
    assert not (out["model_changed"] or out["main_changed"] or out["moments"]), out
