"""The loader's checks, pure: what a step's Megatron records say, and whether its saved layout matches the
live one. Each raises a typed error naming what differs, before the load writes any live tensor."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ckptd.client.state import Shard
from ckptd.writer.errors import InvalidRequestError, LayoutMismatchError, StateMismatchError
from ckptd.writer.format import MEGATRON_CHECKPOINT_VERSION, MEGATRON_RECORD, OPTIM_META, CommitManifest
from ckptd.writer.layout import MegatronLayout, ParamLayout

Record = dict[str, Any]  # a saved rank's ``megatron`` record (plain data)


def saved_records(commit: CommitManifest) -> dict[int, Record]:
    """Each saved rank's Megatron record, by rank."""
    out = {}
    for rank, objects in commit.objects.items():
        rec = objects.get(MEGATRON_RECORD) if isinstance(objects, Mapping) else None
        if isinstance(rec, Mapping):
            if rec.get("version") != MEGATRON_CHECKPOINT_VERSION:
                raise InvalidRequestError(f"step {commit.step}: unsupported Megatron record {rec.get('version')!r}")
            out[int(rank)] = dict(rec)
    if not out:
        raise StateMismatchError(f"step {commit.step} was not written by save_checkpoint: no Megatron layout record")
    return out


def saved_metas(commit: CommitManifest, records: Mapping[int, Record]) -> dict[int, Mapping[str, Any]]:
    """Each saved rank's plain optimizer data (``optim_meta``), by rank; ranks saved without it are left out."""
    objects = {r: commit.objects.get(str(r)) for r in records}
    return {r: o[OPTIM_META] for r, o in sorted(objects.items()) if isinstance(o, Mapping) and OPTIM_META in o}


def uniform_scalars(step: int, metas: Mapping[int, Mapping[str, Any]], base: int) -> dict[str, Any]:
    """Rank ``base``'s plain optimizer data with each scalar per-param state (Adam's ``step``...) as the one
    value all of ``metas`` (every saved rank's) hold, for a load that maps the state onto another layout.

    There a live param's state comes from whichever saved rank held it, so one rule for every such path:
    each (optimizer, state) must be one value over every param of every saved rank, else
    :class:`LayoutMismatchError` names the state and which ranks hold which value. Only a load at the saved
    layout (same TP/PP, buckets and DP size) restores each rank's own saved values, whatever they are."""
    held: dict[tuple[str, str], dict[str, list[int]]] = {}  # (optimizer, state) -> {one value as JSON: ranks}
    for rank, meta in sorted(metas.items()):
        for oi, opt in meta.get("optimizers", {}).items():
            for name, spec in opt.get("scalar_state", {}).items():
                values = [spec["value"]] if "value" in spec else spec.get("by_param", {}).values()
                for value in values:
                    one = json.dumps({"dtype": spec.get("dtype"), "value": value}, sort_keys=True)
                    ranks = held.setdefault((oi, name), {}).setdefault(one, [])
                    if rank not in ranks:
                        ranks.append(rank)
    for (oi, name), by_value in held.items():
        if len(by_value) > 1:
            specs = [json.loads(one) for one in by_value]
            dtypes = len({spec["dtype"] for spec in specs}) > 1
            what = "; ".join(_held(spec, ranks, dtypes) for spec, ranks in zip(specs, by_value.values(), strict=True))
            raise LayoutMismatchError(
                f"step {step}: scalar optimizer state {name!r} of optimizer {oi} differs between the saved ranks "
                f"({what}); loaded at another layout every param takes one value, and which saved rank's it "
                "would be is arbitrary. Load at the saved TP/PP/DP and buckets (each rank restores its own), or "
                "save with one value"
            )
    if not metas:
        raise StateMismatchError(f"step {step} holds no saved rank's optimizer plain data ({OPTIM_META})")
    meta = metas[base] if base in metas else metas[min(metas)]
    optimizers = {
        oi: {**entry, "scalar_state": {n: json.loads(next(iter(v))) for (o, n), v in held.items() if o == oi}}
        for oi, entry in meta.get("optimizers", {}).items()
    }
    return {**meta, "optimizers": optimizers}


def _held(spec: Mapping[str, Any], ranks: list[int], dtype: bool) -> str:
    """``2.0 on ranks 0, 2`` (with the dtype when the ranks' dtypes differ)."""
    shown = ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    value = f"{spec['value']!r} ({spec['dtype']})" if dtype else repr(spec["value"])
    return f"{value} on rank{'s' if len(ranks) > 1 else ''} {shown}"


def check_parallel_sizes(step: int, records: Mapping[int, Record], layout: MegatronLayout) -> None:
    """The step was saved at the live TP and PP sizes (any DP); else :class:`LayoutMismatchError`, the loader's
    reason to read each param by its place in model space."""
    sizes = {(rec["tp_size"], rec["pp_size"]) for rec in records.values()}
    if sizes != {(layout.tp_size, layout.pp_size)}:
        saved = ", ".join(f"TP={t} PP={p}" for t, p in sorted(sizes))
        raise LayoutMismatchError(  # the loader's reason to read by place in model space (merged or merge-free)
            f"step {step} was saved with {saved}; this model runs TP={layout.tp_size} PP={layout.pp_size}"
        )


def check_no_extra_keys(commit: CommitManifest, saved: MegatronLayout, template: Mapping[str, Shard]) -> None:
    """Every model key the step stores for this rank is in the live model (``strict``)."""
    have = {s.key for s in template.values()}
    expected = {saved.model_key(piece.key) for _b, bucket in saved.buckets() for p in bucket.params
                for piece in p.model_pieces}
    if saved.pp_size == 1 and not any(b.is_expert for b in saved.buffers):
        expected |= {rec.name for rec in commit.arrays if rec.name.startswith(saved.model_prefix)}
    extra = sorted(expected - have)
    if extra:
        raise StateMismatchError(
            f"{extra[0]}: in checkpoint step {commit.step} but not in the model"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
            + "; pass strict=False to ignore checkpoint keys the model lacks"
        )


def check_structure(saved: MegatronLayout, live: MegatronLayout) -> None:
    """Same buffers, buckets and params at the same bucket-relative offsets (the DP size may differ)."""
    if len(saved.buffers) != len(live.buffers):
        raise StateMismatchError(f"the checkpoint has {len(saved.buffers)} grad buffers, the model {len(live.buffers)}")
    for sb, lb in zip(saved.buffers, live.buffers, strict=True):
        what = ("optimizer_index", "gbuf_index", "param_dtype", "grad_dtype", "is_expert", "mp")
        s_attrs, l_attrs = ([getattr(b, a) for a in what] for b in (sb, lb))
        if s_attrs != l_attrs:
            raise StateMismatchError(f"grad buffer {lb.index}: checkpoint {s_attrs} vs model {l_attrs} ({what})")
        if len(sb.buckets) != len(lb.buckets):
            raise StateMismatchError(
                f"grad buffer {lb.index}: the checkpoint has {len(sb.buckets)} buckets, the model {len(lb.buckets)} "
                "(another bucket_size or overlap_grad_reduce setting?)"
            )
        for sk, lk in zip(sb.buckets, lb.buckets, strict=True):
            s_params = [(p.name, p.start - sk.start, p.end - sk.start, p.shape) for p in sk.params]
            l_params = [(p.name, p.start - lk.start, p.end - lk.start, p.shape) for p in lk.params]
            for sp, lp in zip(s_params, l_params, strict=False):
                if sp != lp:
                    raise StateMismatchError(
                        f"{lp[0]}: buffer {lb.index} bucket {lk.index} has it at {lp[1:]} (offset, end, shape); "
                        f"the checkpoint has {sp[0]} at {sp[1:]}"
                    )
            for s_param, l_param in zip(sk.params, lk.params, strict=False):
                # the same local param may be another part of the model: a pipeline stage given other layers
                if _model_places(s_param) != _model_places(l_param):
                    raise StateMismatchError(
                        f"{l_param.name}: buffer {lb.index} bucket {lk.index} holds it as "
                        f"{_shown(l_param)}; the checkpoint holds {_shown(s_param)} there (another split of the "
                        "layers over the pipeline stages?)"
                    )
            if len(s_params) != len(l_params):
                longer = s_params if len(s_params) > len(l_params) else l_params
                raise StateMismatchError(
                    f"{longer[min(len(s_params), len(l_params))][0]}: buffer {lb.index} bucket {lk.index} holds "
                    f"{len(s_params)} params in the checkpoint, {len(l_params)} in the model"
                )


def _model_places(param: ParamLayout) -> list[tuple[object, ...]]:
    """Where a param's pieces sit in model space, whatever DP rank holds it (the replica id left out)."""
    return sorted((p.key, p.global_shape, p.global_offset, p.prepend_axis_num, p.view_offset, p.view_shape,
                   p.view_stride) for p in param.model_pieces)


def _shown(param: ParamLayout) -> str:
    """``decoder.layers.self_attention.linear_qkv.weight[2]``: the model key and offset of its first piece."""
    if not param.model_pieces:
        return "no model piece"
    piece = min(param.model_pieces, key=lambda p: (p.key, p.global_offset))
    return f"{piece.key} at {list(piece.global_offset)}"
