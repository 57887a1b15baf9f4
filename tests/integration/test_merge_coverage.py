"""``ckptd merge`` refuses a stored layout whose param's model pieces leave part of the param uncovered, before
it writes anything: that part's optimizer state would be in no merged array, and a load at another layout
would leave it unwritten. A real megatron-core step (the toy GPT on CPU, one gloo rank) is saved three
times; two commits are doctored to name a layout sidecar (a valid, content-addressed one) with a gap: a
SwiGLU ``linear_fc1`` weight without its second piece (a piece missing), the final layernorm's weight
with a piece of half its elements (a module that saved a partial shard; the merged array is then whole,
so nothing else noticed). The untouched step merges as before.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from ckptd.writer import format as fmt
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import ShardLayoutError
from ckptd.writer.layout import ParamLayout, decode_layout
from ckptd.writer.merge import run_merge
from ckptd.writer.root import open_root

pytestmark = pytest.mark.megatron


def _save(rank: int, world: int, socket: str, root: str) -> bool:
    from ckptd.client import CheckpointClient
    from ckptd.client.megatron import save_checkpoint
    from ckptd.testing.toy_gpt import build_gpt

    model, optimizer, train_step = build_gpt(tp=1)
    train_step(0)
    client = CheckpointClient(socket)
    for step in (1, 2, 3):
        save_checkpoint(client, step, model, optimizer).wait(60)
    return True


def _missing_piece(p: ParamLayout) -> ParamLayout | None:
    if len(p.model_pieces) != 2:
        return None
    return msgspec.structs.replace(p, model_pieces=p.model_pieces[:1])


def _partial_shard(p: ParamLayout) -> ParamLayout | None:
    if not p.name.endswith("final_layernorm.weight"):
        return None
    (piece,) = p.model_pieces
    half = (piece.view_shape[0] // 2,)
    return msgspec.structs.replace(p, model_pieces=(msgspec.structs.replace(piece, view_shape=half,
                                                                           global_shape=half),))


async def _doctor(root: str, step: int, change: Callable[[ParamLayout], ParamLayout | None]) -> ParamLayout:
    """Point step ``step``'s commit at a copy of its layout sidecar with the first param ``change`` alters
    altered; that param as it was."""
    async with open_root(root, None) as ckpt:
        commit = await ckpt.read_commit(step)
        record = commit.objects["0"][fmt.MEGATRON_RECORD]
        layout = decode_layout(await ckpt.read_sidecar(record[fmt.LAYOUT_FIELD]))
        found: list[ParamLayout] = []

        def first(p: ParamLayout) -> ParamLayout:
            new = None if found else change(p)
            if new is not None:
                found.append(p)
            return new or p

        text = layout.with_params(first).to_json()
        assert found, "no param to doctor"
        await CheckpointWriter(ckpt.backend).write_sidecar(fmt.sidecar_name(text), text)
        objects = {**commit.objects, "0": {**commit.objects["0"],
                                           fmt.MEGATRON_RECORD: {**record, fmt.LAYOUT_FIELD: fmt.sidecar_name(text)}}}
        doctored = msgspec.structs.replace(commit, objects=objects)
        await ckpt.backend.put(fmt.commit_marker(step), fmt.encode_json(doctored))
        return found[0]


async def _merge(root: str, step: int) -> str:
    async with open_root(root, None) as ckpt:
        try:
            await run_merge(ckpt, step, progress=False)
        except ShardLayoutError as exc:
            return str(exc)
        assert await ckpt.read_merged_manifest(step) is not None
        return ""


def test_merge_refuses_a_param_its_pieces_do_not_cover(tmp_path: Path) -> None:
    from ckptd.testing.toy_gpt import spawn_with_daemon

    root = str(tmp_path / "root")
    assert spawn_with_daemon(_save, 1, root, str(tmp_path / "d.sock"), log_path=str(tmp_path / "d.log")) == [True]
    fc1 = asyncio.run(_doctor(root, 1, _missing_piece))
    norm = asyncio.run(_doctor(root, 2, _partial_shard))

    errs = {step: asyncio.run(_merge(root, step)) for step in (1, 2)}
    written = {step: (Path(root) / fmt.step_dir(step) / fmt.MERGED_DIR).exists() for step in (1, 2)}
    half, n = math.prod(fc1.shape) // 2, math.prod(norm.shape)  # fc1's second piece held its second half
    assert f"{fc1.name} (" in errs[1] and f"leave elements [{half}, {2 * half}) of the flattened" in errs[1], errs
    assert f"{norm.name} (" in errs[2] and f"leave elements [{n // 2}, {n}) of the flattened" in errs[2], errs
    assert written == {1: False, 2: False}  # refused while planning: nothing of a merged layout was written
    assert asyncio.run(_merge(root, 3)) == ""  # the normal case
