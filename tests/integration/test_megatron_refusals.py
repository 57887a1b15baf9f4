"""What the Megatron integration does not take is refused with a typed error before anything is planned,
saved or loaded: Megatron FSDP buffers, precision-aware optimizers, and the optimizer CPU offload
(``optimizer_cpu_offload``: Megatron's ``HybridDeviceOptimizer``, whose state dict is rebuilt at every
step). A real toy GPT with the distributed optimizer, on one gloo rank; each case sets one switch on its
real config, as Megatron's own builders would have."""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.testing.toy_gpt import build_gpt, spawn_ranks

pytestmark = pytest.mark.timeout(180)

SWITCHES = {  # case -> (config object, attribute)
    "fsdp": ("ddp_config", "use_megatron_fsdp"),
    "precision-aware": ("config", "use_precision_aware_optimizer_no_fp8_or_ds_fp8"),
    "cpu offload": ("config", "optimizer_cpu_offload"),
}


def _refusals(rank: int, world: int) -> dict[str, Any]:
    from ckptd.client.megatron.introspect import cpu_offloaded, distributed_optimizers
    from ckptd.client.megatron.layout import get_layout
    from ckptd.writer.errors import InvalidRequestError

    model, optimizer, train_step = build_gpt()
    train_step(0)
    opt = (getattr(optimizer, "chained_optimizers", None) or [optimizer])[0]
    got: dict[str, Any] = {"offloaded before": cpu_offloaded(optimizer)}
    for case, (holder, attr) in SWITCHES.items():
        cfg = getattr(opt, holder)
        before = getattr(cfg, attr)
        setattr(cfg, attr, True)
        # the first save or load of a model and optimizer finds its layout (then kept): it refuses each case
        for name, entry in ((case, lambda: get_layout(model, optimizer)),
                            (f"{case}, optimizers", lambda: distributed_optimizers(optimizer))):
            try:
                entry()
                got[name] = "accepted"
            except InvalidRequestError as exc:
                got[name] = str(exc)
        if case == "cpu offload":
            got["offloaded"] = cpu_offloaded(optimizer)
        setattr(cfg, attr, before)
    got["layout"] = bool(get_layout(model, optimizer))
    return got


def test_unsupported_megatron_setups_are_refused_with_a_typed_error() -> None:
    got = spawn_ranks(_refusals, 1)[0]
    assert got["offloaded before"] is False and got["layout"] is True  # the plain setup is taken
    for entry in ("", ", optimizers"):
        assert got[f"fsdp{entry}"] == "Megatron FSDP buffers are not supported"
        assert got[f"precision-aware{entry}"].startswith("precision-aware optimizers")
        assert got[f"cpu offload{entry}"].startswith(
            "optimizer CPU offload (optimizer_cpu_offload, Megatron's HybridDeviceOptimizer) is not supported")
    assert got["offloaded"] is True  # what verl's manager asks before it hands a save to ckptd
