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

:func:`model_space_states` is :func:`param_states` for any TP/PP/DP/EP layout: it names each param as in the
whole model (PP stages' layers by their global layer number, MoE experts by their global expert index, no
optimizer index), gives expert params their expert-TP coordinates, marks a last PP stage's copy of tied
embeddings, and adds each rank's whole local model param (``whole``), which :func:`full_states` requires to be
the same bytes on every DP rank holding it. Used by the reshard tests (``tests/integration/test_reshard*.py``)
to compare a load at another layout element for element with the state the saving ranks held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

TIED = "~tied"  # suffix of a last PP stage's copy of the embeddings tied to the output layer


def param_states(model: Sequence[Any], optimizer: Any) -> dict[str, dict[str, Any]]:
    """This rank's view of each param: TP coordinates, local shape, and per state (``main`` included) the
    flat range it holds with its values; scalar state (Adam's ``step``) as floats."""
    return _views(model, optimizer, model_space=False)


def model_space_states(model: Sequence[Any], optimizer: Any) -> dict[str, dict[str, Any]]:
    """:func:`param_states` named and placed in the whole model, at any TP/PP/DP/EP (see the module's
    docstring), with each param's whole local model tensor under ``whole`` (``{"model": ...}``), also for the
    params of which this rank's optimizer holds no range (``scalars`` None)."""
    return _views(model, optimizer, model_space=True)


def _global_names(chunk: Any) -> dict[Any, str]:
    """param -> its name in the whole model: a PP stage's ``layers.<i>`` by the layer's global number, a MoE
    layer's ``experts.local_experts.<j>`` by its global expert index, a last stage's tied embedding copy
    under the first stage's name with :data:`TIED` appended."""
    out = {}
    for name, param in chunk.named_parameters():
        local = name.split(".")
        parts = list(local)
        for i, part in enumerate(local[:-1]):
            if not part.isdigit() or i == 0:
                continue
            if local[i - 1] == "layers":  # TransformerLayer.layer_number: 1-based, offset by the PP stage
                parts[i] = str(chunk.get_submodule(".".join(local[: i + 1])).layer_number - 1)
            elif local[i - 2 : i] == ["experts", "local_experts"]:  # the MoE layer knows its experts' indices
                parts[i] = str(chunk.get_submodule(".".join(local[: i - 2])).local_expert_indices[int(part)])
        out[param] = ".".join(parts)
        if local[-2:] == ["output_layer", "weight"] and getattr(param, "shared", False):
            out[param] = "embedding.word_embeddings.weight" + TIED  # PP > 1: the last stage's copy
    return out


def _views(model: Sequence[Any], optimizer: Any, *, model_space: bool) -> dict[str, dict[str, Any]]:
    from megatron.core import parallel_state
    from megatron.core.transformer.mlp import MLP
    from megatron.core.utils import unwrap_model

    tp = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    etp = (parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size())
    chunks = [unwrap_model(c) for c in model]
    gated = {  # a gated MLP's fc1 holds on each TP rank its piece of the gate, then its piece of the rest
        p for c in chunks for m in c.modules()
        if isinstance(m, MLP) and m.config.gated_linear_unit for p in m.linear_fc1.parameters()
    }

    def view(param: Any, start: int, states: dict[str, torch.Tensor], scalars: dict[str, float] | None) -> Any:
        expert = model_space and not getattr(param, "allreduce", True)  # experts: split over expert TP
        out = {
            "tp": (etp if expert else tp)[0],
            "tp_size": (etp if expert else tp)[1],
            "dim": param.partition_dim if getattr(param, "tensor_model_parallel", False) else None,
            "gated": param in gated,
            "shape": tuple(param.shape),
            "start": start,
            "states": states,
            "scalars": scalars,
        }
        if model_space:
            out["whole"] = {"model": param.detach().reshape(-1).clone()}
        return out

    out: dict[str, dict[str, Any]] = {}
    for oi, opt in enumerate(optimizer.chained_optimizers):
        if model_space:
            names = {p: n for c in opt.model_chunks for p, n in _global_names(unwrap_model(c)).items()}
        else:
            names = {p: f"{oi}/{n}" for c in opt.model_chunks for n, p in unwrap_model(c).named_parameters()}
        for param, (gi, go) in opt.model_param_group_index_map.items():
            main = opt.optimizer.param_groups[gi]["params"][go]
            span = opt._get_model_param_range_map(param)["param"]
            tensors = {"main": main, **opt.optimizer.state.get(main, {})}
            out[names[param]] = view(
                param, span.start,
                {k: v.detach().reshape(-1).clone() for k, v in tensors.items() if _is_range(v, span.size)},
                {k: float(v) for k, v in tensors.items() if not _is_range(v, span.size)},
            )
    if model_space:  # the model params of which this rank's optimizer holds no range
        for c in chunks:
            for param, name in _global_names(c).items():
                if name not in out:
                    out[name] = view(param, 0, {}, None)
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
            for state, values in view.get("whole", {}).items():  # the whole local tensor, on every DP rank
                if state in piece["states"] and not _same(piece["states"][state], values):
                    out.problems.append(f"{name}/{state}: TP rank {view['tp']}'s copy differs between DP ranks")
                piece["states"][state] = values
                piece["seen"][state] = torch.ones(numel, dtype=torch.int32)
            if view["scalars"] is None:  # a rank holding the model param but no optimizer range of it
                continue
            scalars = out.scalars.setdefault(name, dict(view["scalars"]))
            if scalars != view["scalars"]:
                out.problems.append(f"{name}: scalar state differs between ranks ({scalars} / {view['scalars']})")
    for name, by_tp in sorted(pieces.items()):
        out.states[name] = _joined(name, by_tp, out.problems)
    for name in [n for n in out.states if n.endswith(TIED)]:  # a copy of tied embeddings: checked, then dropped
        base = name[: -len(TIED)]
        copy, scalars = out.states.pop(name), out.scalars.pop(name, {})
        if base not in out.states or sorted(copy) != sorted(out.states[base]) or scalars != out.scalars.get(base):
            out.problems.append(f"{base}: its tied copy holds other states ({sorted(copy)}, {scalars})")
        else:
            out.problems += [f"{base}/{k}: its tied copy differs" for k, v in copy.items()
                             if not _same(v, out.states[base][k])]
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bytes (NaNs included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _joined(name: str, by_tp: dict[int, dict[str, Any]], problems: list[str]) -> dict[str, torch.Tensor]:
    """A param's full tensor per state from its TP pieces (each already whole over DP)."""
    first = by_tp[min(by_tp)]["view"]
    if sorted(by_tp) != list(range(first["tp_size"])):
        problems.append(f"{name}: held by TP ranks {sorted(by_tp)} of {first['tp_size']}")
        return {}
    joined = {}
    for state in sorted({state for piece in by_tp.values() for state in piece["states"]}):
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
            elif all(_same(p, parts[0]) for p in parts):
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
            elif not _same(a[state], b[state]):
                differs.append(f"{name}/{state}: values differ")
            else:
                compared += a[state].numel()
        if saved.scalars.get(name) != loaded.scalars.get(name):
            differs.append(f"{name}: scalar state {saved.scalars.get(name)} / {loaded.scalars.get(name)}")
    return compared, differs


def reference(ranks: Sequence[dict[str, dict[str, Any]]]) -> FullStates:
    """The saving ranks' :func:`model_space_states` put back together, checked whole: every param holds its
    fp32 main param, Adam's two moments and its model tensor, and nothing failed to join."""
    saved = full_states(ranks)
    assert saved.problems == [], saved.problems[:10]
    assert saved.states and all(sorted(s) == ["exp_avg", "exp_avg_sq", "main", "model"] for s in saved.states.values())
    assert all(s["main"].dtype == torch.float32 for s in saved.states.values())
    return saved


def assert_loaded_as_saved(saved: FullStates, ranks: Sequence[dict[str, dict[str, Any]]], what: str) -> int:
    """The loading ranks' :func:`model_space_states` hold exactly ``saved``: every param, every state (the fp32
    main param, each moment, the model tensor) bit for bit, the same scalar state, nothing more. Returns the
    number of values compared."""
    compared, differs = compare_runs(saved, full_states(ranks))
    assert differs == [], f"{what}: {len(differs)} differences, first: {differs[:10]}"
    total = sum(t.numel() for states in saved.states.values() for t in states.values())
    assert compared == total, (what, compared, total)
    return compared
