"""How large the staging arena must be for a model: the rule behind ``ckptd plan``.

Pure arithmetic, no I/O. A rank stages its share of

- the model weights: its TPxPP slice of the parameters (``params / (TP·PP)``), of which every DP rank
  stages ``1/DP`` (replicated tensors are split over data parallelism, so each byte is staged once per
  model-parallel group), at the weights' dtype (2 bytes for bf16/fp16, 4 for fp32);
- the distributed optimizer's state: the DP-local slice of every grad-buffer bucket, i.e.
  ``params / (TP·PP·DP)`` elements per rank, each with an fp32 main param and the optimizer's
  per-element state (Adam: ``exp_avg`` and ``exp_avg_sq``, fp32) — 12 bytes per element.

So a rank stages about ``params / (TP·PP·DP) * (weight bytes + 12)`` bytes (14 B/param for bf16 weights
with Adam), and a node the sum over its ranks. Expert parallelism does not change the total (experts are
split over EP instead of replicated); bucket padding adds at most ``lcm(DP, 128)`` elements per bucket.

A save waits for arena space while the previous one drains (the client's ``backpressure="wait"``), so one
step's worth is the minimum; twice that lets a save start while the previous one is still being written.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ckptd.writer.errors import ConfigError

WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
# per-element optimizer bytes staged per parameter element: the fp32 main param plus the state tensors
OPTIMIZER_BYTES = {"adam": 4 + 8, "sgd": 4 + 4, "none": 0}
HEADROOM = 1.05  # bucket padding, small plain objects, allocator alignment


@dataclass(frozen=True)
class ArenaPlan:
    params: int
    tp: int
    pp: int
    dp: int
    ranks_per_node: int
    weight_dtype: str
    optimizer: str
    bytes_per_param: int
    per_rank_bytes: int
    per_node_bytes: int
    minimum_arena_bytes: int  # one step staged at a time (saves wait for the previous drain)
    overlap_arena_bytes: int  # a save may start while the previous one drains

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)


def plan_arena(
    params: int, *, tp: int = 1, pp: int = 1, dp: int = 1, ranks_per_node: int = 8,
    weight_dtype: str = "bf16", optimizer: str = "adam",
) -> ArenaPlan:
    """The staging bytes a node needs for a model of ``params`` parameters at this parallelism."""
    for name, value in (("params", params), ("tp", tp), ("pp", pp), ("dp", dp), ("ranks_per_node", ranks_per_node)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if weight_dtype not in WEIGHT_BYTES:
        raise ConfigError(f"weight dtype {weight_dtype!r} is not one of {sorted(WEIGHT_BYTES)}")
    if optimizer not in OPTIMIZER_BYTES:
        raise ConfigError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_BYTES)}")
    world = tp * pp * dp
    if ranks_per_node > world:
        ranks_per_node = world
    per_param = WEIGHT_BYTES[weight_dtype] + OPTIMIZER_BYTES[optimizer]
    per_rank = math.ceil(params / world) * per_param
    per_node = math.ceil(per_rank * ranks_per_node * HEADROOM)
    minimum = _round_up(per_node, 1 << 30)
    return ArenaPlan(
        params=params, tp=tp, pp=pp, dp=dp, ranks_per_node=ranks_per_node, weight_dtype=weight_dtype,
        optimizer=optimizer, bytes_per_param=per_param, per_rank_bytes=per_rank, per_node_bytes=per_node,
        minimum_arena_bytes=minimum, overlap_arena_bytes=_round_up(2 * per_node, 1 << 30),
    )


def parse_count(text: str) -> int:
    """``"7e9"``, ``"70B"``, ``"1.5T"``, ``"350M"`` or a plain integer, as a parameter count."""
    t = text.strip().upper().replace("_", "")
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError as exc:
        raise ConfigError(f"not a parameter count: {text!r} (e.g. 7e9, 70B, 350M)") from exc
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"not a parameter count: {text!r}")
    return int(value)


def _round_up(n: int, unit: int) -> int:
    return max(unit, -(-n // unit) * unit)
