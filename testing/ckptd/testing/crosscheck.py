"""Compare a Megatron model's optimizer state across parallel layouts, element for element.

A rank of the distributed optimizer holds, for each param, one contiguous range of the param's flat elements
(its DP shard) of the fp32 main param and of each state (Adam's ``exp_avg``, ``exp_avg_sq``); with tensor
parallelism the param itself is this TP rank's piece, cut along its ``partition_dim`` (a gated MLP's fc1:
this rank's piece of the gate followed by its piece of the other half). :func:`param_states`
takes one rank's view; :func:`full_states` puts the ranks' views of one run back together, param by param in
model space (every element from exactly one DP rank, the TP pieces joined, TP-replicated params checked to be
equal on every TP rank); :func:`compare_runs` compares two runs' results byte for byte. For an fp32 model the
main param is a view of the model param, so this checks the model's values too.

Used by ``ckptd demo`` to check a reload at another TP/DP (from the stored DP bucket slices without a merge,
and from the merged layout) against the state the saving ranks held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def param_states(model: Sequence[Any], optimizer: Any) -> dict[str, dict[str, Any]]:
    """This rank's view of each param: TP coordinates, local shape, and per state (``main`` included) the
    flat range it holds with its values; scalar state (Adam's ``step``) as floats."""
    from megatron.core import parallel_state
    from megatron.core.transformer.mlp import MLP
    from megatron.core.utils import unwrap_model

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    out: dict[str, dict[str, Any]] = {}
    for oi, opt in enumerate(optimizer.chained_optimizers):
        names = {p: n for c in opt.model_chunks for n, p in unwrap_model(c).named_parameters()}
        gated = {  # a gated MLP's fc1 holds on each TP rank its piece of the gate, then its piece of the rest
            p for c in opt.model_chunks for m in unwrap_model(c).modules()
            if isinstance(m, MLP) and m.config.gated_linear_unit for p in m.linear_fc1.parameters()
        }
        for param, (gi, go) in opt.model_param_group_index_map.items():
            main = opt.optimizer.param_groups[gi]["params"][go]
            span = opt._get_model_param_range_map(param)["param"]
            tensors = {"main": main, **opt.optimizer.state.get(main, {})}
            out[f"{oi}/{names[param]}"] = {
                "tp": tp_rank,
                "tp_size": tp_size,
                "dim": param.partition_dim if getattr(param, "tensor_model_parallel", False) else None,
                "gated": param in gated,
                "shape": tuple(param.shape),
                "start": span.start,
                "states": {k: v.detach().reshape(-1).clone() for k, v in tensors.items() if _is_range(v, span.size)},
                "scalars": {k: float(v) for k, v in tensors.items() if not _is_range(v, span.size)},
            }
    return out


def _is_range(value: Any, size: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == size


@dataclass
class FullStates:
    """One run's optimizer state per param in model space, and what could not be put back together."""

    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # param -> state -> full tensor
    scalars: dict[str, dict[str, float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def full_states(ranks: Sequence[dict[str, dict[str, Any]]]) -> FullStates:
    """Put the ranks' :func:`param_states` back together (see the module's docstring)."""
    pieces: dict[str, dict[int, dict[str, Any]]] = {}  # param -> TP rank -> its view, DP ranges joined
    out = FullStates()
    for views in ranks:
        for name, view in views.items():
            piece = pieces.setdefault(name, {}).setdefault(view["tp"], {"view": view, "states": {}, "seen": {}})
            numel = int(torch.Size(view["shape"]).numel())
            for state, values in view["states"].items():
                flat = piece["states"].setdefault(state, torch.empty(numel, dtype=values.dtype))
                seen = piece["seen"].setdefault(state, torch.zeros(numel, dtype=torch.int32))
                flat[view["start"]:view["start"] + values.numel()] = values
                seen[view["start"]:view["start"] + values.numel()] += 1
            scalars = out.scalars.setdefault(name, dict(view["scalars"]))
            if scalars != view["scalars"]:
                out.problems.append(f"{name}: scalar state differs between ranks ({scalars} / {view['scalars']})")
    for name, by_tp in sorted(pieces.items()):
        out.states[name] = _joined(name, by_tp, out.problems)
    return out


def _joined(name: str, by_tp: dict[int, dict[str, Any]], problems: list[str]) -> dict[str, torch.Tensor]:
    """A param's full tensor per state from its TP pieces (each already whole over DP)."""
    first = by_tp[min(by_tp)]["view"]
    if sorted(by_tp) != list(range(first["tp_size"])):
        problems.append(f"{name}: held by TP ranks {sorted(by_tp)} of {first['tp_size']}")
        return {}
    joined = {}
    for state in by_tp[min(by_tp)]["states"]:
        parts = []
        for tp in sorted(by_tp):
            piece = by_tp[tp]
            seen = piece["seen"].get(state)
            if seen is None or bool((seen != 1).any()):
                problems.append(f"{name}/{state}: TP rank {tp}'s DP ranges do not cover it exactly once")
                break
            parts.append(piece["states"][state].reshape(piece["view"]["shape"]))
        else:
            if first["dim"] is not None and first["gated"]:  # all TP pieces of the gate, then of the rest
                halves = [p.chunk(2, dim=first["dim"]) for p in parts]
                joined[state] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=first["dim"])
            elif first["dim"] is not None:
                joined[state] = torch.cat(parts, dim=first["dim"])
            elif all(torch.equal(p.view(torch.uint8), parts[0].view(torch.uint8)) for p in parts):
                joined[state] = parts[0]  # replicated over TP: the same bytes on every TP rank
            else:
                problems.append(f"{name}/{state}: a TP-replicated param differs between TP ranks")
    return joined


def compare_runs(saved: FullStates, loaded: FullStates) -> tuple[int, list[str]]:
    """(values compared, what differs): every param and state of ``saved`` must be in ``loaded``, same bytes."""
    differs = [f"saved: {p}" for p in saved.problems] + [f"loaded: {p}" for p in loaded.problems]
    compared = 0
    for name in sorted(set(saved.states) | set(loaded.states)):
        a, b = saved.states.get(name, {}), loaded.states.get(name, {})
        for state in sorted(set(a) | set(b)):
            if state not in a or state not in b:
                differs.append(f"{name}/{state}: only in the {'saved' if state in a else 'loaded'} run")
            elif a[state].shape != b[state].shape or not torch.equal(a[state].view(torch.uint8),
                                                                     b[state].view(torch.uint8)):
                differs.append(f"{name}/{state}: values differ")
            else:
                compared += a[state].numel()
        if saved.scalars.get(name) != loaded.scalars.get(name):
            differs.append(f"{name}: scalar state {saved.scalars.get(name)} / {loaded.scalars.get(name)}")
    return compared, differs
