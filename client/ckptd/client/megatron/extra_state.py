"""Modules' ``_extra_state`` (Transformer Engine's FP8 scaling factors and amax history) as plain data.

TE modules override ``get_extra_state``/``set_extra_state``; the state is a ``torch.Tensor`` (a uint8
buffer in recent TE) or an ``io.BytesIO`` (older TE), and it changes every step, so it is read at every
save (cheap: a walk over the modules) rather than cached with the plan. It is per rank (TP-sharded
layers keep their own amax), so each rank stores its own under ``extra_state`` in its objects, keyed by
the module's name inside the unwrapped chunk; the loading rank restores the one of the saved rank it
takes RNG and ``extra`` from (same TP/PP/EP/ETP/DP coordinates: :mod:`.rank_state`).
"""

from __future__ import annotations

import base64
import dis
import io
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ckptd.client.megatron import introspect
from ckptd.client.state import dtype_name, torch_dtype
from ckptd.writer.errors import InvalidRequestError, StateMismatchError

EXTRA_STATE_RECORD = "extra_state"  # the per-rank objects entry: {"<chunk>/<module name>": encoded state}
LAYERS_FIELD = "layers"  # the megatron record's entry: per model chunk, its transformer layers' global numbers

_LAYER = re.compile(r"(?:^|\.)layers\.\d+$")


def chunk_layers(model_chunks: Sequence[torch.nn.Module]) -> list[list[int]]:
    """Per model chunk, the ``layer_number`` (global, 1-based) of each of its transformer layers in order.

    The stored names (``<chunk>/<module name>``) say which module's ``_extra_state`` it is only together with
    this: the same name is another layer when the layers are split otherwise over the chunks (virtual pipeline
    stages added or removed, another ``--decoder-first/last-pipeline-num-layers``) at the same TP/PP sizes."""
    out = []
    for chunk in model_chunks:
        out.append([m.layer_number for name, m in introspect.unwrap(chunk).named_modules()
                    if _LAYER.search(name) and isinstance(getattr(m, "layer_number", None), int)])
    return out


def _with_extra_state(model_chunks: Sequence[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Module]]:
    for i, chunk in enumerate(model_chunks):
        for name, module in introspect.unwrap(chunk).named_modules():
            if type(module).get_extra_state is not torch.nn.Module.get_extra_state:
                yield f"{i}/{name}", module


def _b64(data: bytes) -> str:
    # the per-rank objects are plain data (the commit manifest is JSON): bytes travel as base64
    return base64.b64encode(data).decode("ascii")


def _encode(name: str, state: object) -> dict[str, Any] | None:
    if state is None:
        return None
    if isinstance(state, io.BytesIO):
        return {"kind": "bytesio", "b64": _b64(state.getvalue())}
    if isinstance(state, torch.Tensor):
        t = state.detach().cpu().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"kind": "tensor", "dtype": dtype_name(t.dtype), "shape": list(t.shape), "b64": _b64(raw)}
    if isinstance(state, bytes):
        return {"kind": "bytes", "b64": _b64(state)}
    if isinstance(state, str | int | float | bool):
        return {"kind": "plain", "data": state}
    raise InvalidRequestError(f"{name}: _extra_state of type {type(state).__name__} cannot be stored as plain data")


def _decode(entry: Mapping[str, Any], like: object) -> object:
    kind = entry["kind"]
    if kind == "bytesio":
        return io.BytesIO(base64.b64decode(entry["b64"]))
    if kind == "bytes":
        return base64.b64decode(entry["b64"])
    if kind == "tensor":
        dtype = torch_dtype(entry["dtype"])
        raw = bytearray(base64.b64decode(entry["b64"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        t = flat.view(dtype).reshape(entry["shape"]).clone()
        return t.to(like.device) if isinstance(like, torch.Tensor) else t
    return entry["data"]


def extra_state_modules(model_chunks: Sequence[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """The modules that keep an ``_extra_state``, by stored name: what :func:`extra_states` reads. A cached
    save plan keeps this list while its module watch holds (the walk costs ~4 µs a module). Left
    out: modules whose ``get_extra_state`` is code that only returns None (megatron-core's local
    ``ColumnParallelLinear``/``RowParallelLinear``, kept "for compatibility with TE state dict": thousands
    of them in a deep model, ~1 µs each a save for nothing); one set on the instance is kept."""
    return [(n, m) for n, m in _with_extra_state(model_chunks)
            if "get_extra_state" in vars(m) or not _returns_none(type(m).get_extra_state)]


def _returns_none(fn: object) -> bool:
    """Whether ``fn``'s code is ``return None`` alone (a docstring aside): no call, no branch, no state."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in ("RESUME", "NOP")]
    return ops in ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


def extra_states(
    model_chunks: Sequence[torch.nn.Module], modules: Sequence[tuple[str, torch.nn.Module]] | None = None
) -> dict[str, Any]:
    """Every module's current ``_extra_state`` (those that have one), encoded as plain data; ``modules``:
    :func:`extra_state_modules` of ``model_chunks``, when the caller keeps it."""
    out = {}
    for name, module in _with_extra_state(model_chunks) if modules is None else modules:
        enc = _encode(name, module.get_extra_state())
        if enc is not None:
            out[name] = enc
    return out


def check_extra_states(model_chunks: Sequence[torch.nn.Module], saved: object) -> None:
    """:class:`StateMismatchError` if a module has extra state now but the checkpoint none (before any write)."""
    saved = saved if isinstance(saved, Mapping) else {}
    for name, module in _with_extra_state(model_chunks):
        if name not in saved and module.get_extra_state() is not None:
            raise StateMismatchError(f"{name}._extra_state: the module has extra state, the checkpoint none")


def restore_extra_states(model_chunks: Sequence[torch.nn.Module], saved: object) -> int:
    """Give each module its saved ``_extra_state`` back (``set_extra_state``); returns how many were set."""
    saved = saved if isinstance(saved, Mapping) else {}
    modules = dict(_with_extra_state(model_chunks))
    count = 0
    for name, module in modules.items():
        if name in saved:
            module.set_extra_state(_decode(saved[name], module.get_extra_state()))
            count += 1
    return count
