"""A stand-in for a Transformer Engine module's ``_extra_state`` (TE's FP8 metadata) on CPU."""

from __future__ import annotations

from typing import Any

import torch


class AmaxState(torch.nn.Module):
    """No params; its ``_extra_state`` is its ``amax`` (4 float32 values) as a uint8 tensor, as TE's is."""

    def __init__(self, value: float = 0.0) -> None:
        super().__init__()
        self.amax = torch.full((4,), value)

    def get_extra_state(self) -> torch.Tensor:
        return self.amax.clone().view(torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        self.amax = state.view(torch.float32).clone()
