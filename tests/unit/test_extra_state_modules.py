"""Which modules a planned save reads ``_extra_state`` from: those whose ``get_extra_state`` can return
something; code that only returns None (megatron-core's local linears) is left out of the per-save walk."""

from __future__ import annotations

from typing import Any

import torch

from ckptd.client.megatron.extra_state import extra_state_modules, extra_states


class _Local(torch.nn.Linear):
    def get_extra_state(self) -> None:
        """Keep compatibility with TE state dict."""
        return None


class _Bare(torch.nn.Linear):
    def get_extra_state(self) -> None:
        pass


class _Fp8(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.amax = torch.tensor([1.5, 2.5])

    def get_extra_state(self) -> Any:
        return self.amax

    def set_extra_state(self, state: Any) -> None:
        self.amax = state


class _Sometimes(torch.nn.Linear):
    on = False

    def get_extra_state(self) -> Any:
        return "on" if self.on else None


def test_only_modules_that_can_return_state_are_read() -> None:
    chunk = torch.nn.Sequential(_Local(2, 2), _Bare(2, 2), _Fp8(), _Sometimes(2, 2), _Local(2, 2))
    chunk[4].get_extra_state = lambda: "set on the instance"  # type: ignore[method-assign]
    names = [n for n, _ in extra_state_modules([chunk])]
    assert names == ["0/2", "0/3", "0/4"]
    chunk[3].on = True
    got = extra_states([chunk], extra_state_modules([chunk]))
    assert got == extra_states([chunk])  # the same record as walking every module
    assert sorted(got) == ["0/2", "0/3", "0/4"] and got["0/3"]["data"] == "on"
