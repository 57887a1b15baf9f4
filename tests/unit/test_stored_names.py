"""Every stored Megatron/merge name is defined once, in ckptd.writer.format: rename them there and the saver's
key builder, the offline merge and both loaders (DP layout and merged layout) still agree.

The scenario runs the real functions on a local root without Megatron ranks: a synthetic two-bucket layout,
a live torch Adam as the inner optimizer (bound through the plan cache as ``bind`` would), the save path's
bucket-slice shards written as the daemon writes them, ``run_merge``, then both read paths. It runs in a
subprocess that patches the format constants before anything else imports them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent

RENAMED = {
    "MODEL_PREFIX": "mdl/",
    "OPTIM_PREFIX": "opt.state/",
    "OPTIM_META": "ometa",
    "MAIN_PARAM": "main",
    "MEGATRON_RECORD": "mgt",
    "LAYOUT_FIELD": "layout_sidecar",
    "MERGED_DIR": "resharded",
    "MERGED_MARKER": "DONE",
    "MERGED_PROGRESS_DIR": "_prog",
    "STATE_PREFIX": "opt.st.",
}
DEFAULT_SPELLINGS = ("model/", "optim/", "merged/", "optimizer.state.", "/param", "MERGED")


def _scenario(root: str, separator: str | None = None) -> dict[str, Any]:
    import asyncio
    from dataclasses import dataclass

    import torch

    from ckptd.client.megatron.checks import saved_records
    from ckptd.client.megatron.introspect import Owned
    from ckptd.client.megatron.layout import Binding, rank_plan
    from ckptd.client.megatron.optimizer import apply_optimizer_state, optimizer_read_regions, optimizer_shards
    from ckptd.client.megatron.reshard import merged_optimizer_slices
    from ckptd.client.megatron.save import megatron_record
    from ckptd.client.megatron.targets import optimizer_regions
    from ckptd.client.reader import read_flat_async
    from ckptd.writer import format as fmt
    from ckptd.writer.arrays import ChunkSink, array_metadata, write_metadata
    from ckptd.writer.backends import open_backend
    from ckptd.writer.commit import CheckpointWriter
    from ckptd.writer.layout import BucketLayout, BufferLayout, MegatronLayout, ModelPiece, ParamLayout
    from ckptd.writer.merge import layout_names, plan_merge, run_merge
    from ckptd.writer.root import open_root

    def piece(
        key: str, shape: tuple[int, ...], off: tuple[int, ...], view_off: int, view: tuple[int, ...]
    ) -> ModelPiece:
        stride = tuple(int(torch.empty(view).stride()[i]) for i in range(len(view)))
        return ModelPiece(key, shape, off, 0, view_off, view, stride, (0, 0, 0))

    w = ParamLayout("w", 0, 128, 0, (8, 16), (piece("layers.w", (8, 16), (0, 0), 0, (8, 16)),))
    b = ParamLayout("b", 128, 144, 0, (16,), (piece("layers.b", (16,), (0,), 0, (16,)),))
    v = ParamLayout("v", 256, 384, 1, (4, 32), (  # two pieces of one param, like SwiGLU's fc1
        piece("layers.fc1", (4, 32), (0, 0), 0, (2, 32)), piece("layers.fc1", (4, 32), (2, 0), 64, (2, 32))))
    buckets = (BucketLayout(0, 0, 256, 144, (w, b)), BucketLayout(1, 256, 512, 128, (v,)))
    buf = BufferLayout(0, 0, 0, 0, "float32", "float32", False, fmt.optim_mp(0, 0), 1, 0, 0, buckets)
    layout = MegatronLayout(0, 1, 0, 1, 0, 1, (buf,))

    # the live inner optimizer: one flat fp32 main shard per param, stepped once by torch Adam
    torch.manual_seed(0)
    mains = {p.name: torch.nn.Parameter(torch.randn(p.end - p.start)) for _bk in buckets for p in _bk.params}
    inner = torch.optim.Adam(list(mains.values()), lr=0.1)
    for m in mains.values():
        m.grad = torch.randn_like(m)
    inner.step()

    @dataclass(eq=False)
    class FakeOptimizer:
        name: str = "fake"

    opt = FakeOptimizer()
    owned = {(0, k.index): [Owned(p, p.start - k.start, p.end - k.start, mains[p.name], inner, 0) for p in k.params]
             for k in buckets}
    rank_plan(opt).binding = Binding(layout, owned, {})

    # the saver: the bucket-slice shards, staged as save_checkpoint stages them, and the rank's record
    shards = optimizer_shards(opt, layout)
    saved = {k: s.materialize() for k, s in shards.items()}
    text = layout.to_json()
    record = megatron_record(layout, text)
    model_grid = {"layers.w": [4, 16], "layers.b": [16], "layers.fc1": [2, 32]}

    sep = separator or fmt.CHUNK_SEPARATOR  # the saved step's chunk keys

    async def write() -> None:
        async with await open_backend(root, None, create=True) as backend:
            ckpt = CheckpointWriter(backend)
            sink = ChunkSink(backend)
            arrays = []
            for key, t in saved.items():
                shape, grid = [t.numel()], [t.numel()]
                path = f"{fmt.step_dir(1)}/{key}"
                meta = await array_metadata("float32", shape, grid, separator=sep)
                await write_metadata(backend.store, path, meta)
                crc, pieces = await sink.put(f"{path}/{fmt.chunk_key((0,), sep)}", t.numpy())
                chunk = fmt.ChunkRecord([0], t.numel() * 4, crc, pieces)
                arrays.append(fmt.ArrayRecord(key, "float32", shape, grid, [fmt.ShardRecord(0, [0], shape, [chunk])],
                                              separator=sep))
            for key, grid in model_grid.items():  # model arrays: only their records matter to the merge
                shape = {"layers.w": [8, 16], "layers.b": [16], "layers.fc1": [4, 32]}[key]
                arrays.append(
                    fmt.ArrayRecord(layout.model_key(key), "float32", shape, grid, separator=sep)
                )
            commit = fmt.CommitManifest(fmt.FORMAT_VERSION, 1, 1, 1, sorted(arrays, key=lambda a: a.name),
                                        {"0": {fmt.MEGATRON_RECORD: record}}, 0, 0.0)
            await ckpt.write_sidecar(fmt.sidecar_name(text), text)
            await backend.put(f"{fmt.step_dir(1)}/{fmt.COMMIT_MARKER}", fmt.encode_json(commit))

    async def check() -> dict[str, Any]:
        await write()
        async with open_root(root, None) as ckpt:
            commit = await ckpt.read_commit(1)
            # the merge planner finds every bucket the saver wrote, under the prefix the loaders read
            plan = plan_merge(commit, [layout])
            assert {t.source_prefix for t in plan.tasks} == set(optimizer_read_regions(layout))
            assert {s for t in plan.tasks for s in t.states} == {fmt.MAIN_PARAM, "exp_avg", "exp_avg_sq"}
            assert layout_names(commit.objects) == {"0": fmt.sidecar_name(text)}
            # it found the model arrays too: the merged arrays take their chunk grids
            merged_grids = {n: list(a.chunks) for n, a in plan.arrays.items()}
            for key, grid in model_grid.items():
                assert merged_grids[fmt.merged_array_name("exp_avg", key)] == grid
            summary = await run_merge(ckpt, 1, progress=False)
            assert summary.tasks == 2 and not summary.already_merged
            assert (await run_merge(ckpt, "latest", progress=False)).already_merged
            manifest = await ckpt.read_merged_manifest(1)
            assert manifest is not None

            # the merged-layout loader rebuilds exactly the saved slices
            merged = await merged_optimizer_slices(ckpt, 1, manifest, layout)
            assert set(merged) == set(saved)
            for key, t in saved.items():
                assert torch.equal(merged[key], t), key

            # the DP-layout loader: the records, every stored state's region, the slices, and apply
            assert saved_records(commit) == {0: record}
            regions, _dtypes = optimizer_regions(commit, layout, opt)
            assert set(regions) == set(saved)
            flat = await read_flat_async(ckpt, commit, regions)
            before = {n: {k: v.clone() for k, v in inner.state[m].items()} for n, m in mains.items()}
            with torch.no_grad():
                for m in mains.values():
                    inner.state[m]["exp_avg"].zero_()
                    m.zero_()
            apply_optimizer_state(opt, layout, flat, copy_to_model=False)
            for n, m in mains.items():
                assert torch.equal(inner.state[m]["exp_avg"], before[n]["exp_avg"]), n
                assert torch.equal(m.detach(), saved[layout.bucket_key(buf, buckets[0 if n != "v" else 1],
                                                                      fmt.MAIN_PARAM)][_span(owned, n)]), n
        stored = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())
        return {"stored": stored, "merged_arrays": sorted(a.name for a in manifest.arrays)}

    return asyncio.run(check())


def _span(owned: dict[tuple[int, int], list[Any]], name: str) -> slice:
    o = next(o for entries in owned.values() for o in entries if o.param.name == name)
    return slice(o.lo, o.hi)


def _run(root: Path, renamed: dict[str, str], separator: str | None = None) -> dict[str, Any]:
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "import ckptd.writer.format as fmt\n"
        f"for k, v in {renamed!r}.items():\n"
        "    assert hasattr(fmt, k), k\n"
        "    setattr(fmt, k, v)\n"
        "import test_stored_names as t\n"
        f"print(json.dumps(t._scenario({str(root)!r}, {separator!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _merged_chunks(stored: list[str]) -> list[str]:
    return [n for n in stored if n.startswith("step_1/merged/optimizer.state.") and not n.endswith("zarr.json")]


def test_a_step_with_older_chunk_keys_merges_with_them(tmp_path: Path) -> None:
    """A step of format 3 or older (chunk keys ``c/<i>/<j>``) merges and loads, and its merged arrays take
    its chunk keys: a merge such a step began under an older ckptd and a newer one resumes adds the keys
    the first run wrote."""
    result = _run(tmp_path / "ckpt", {}, separator="/")
    chunks = _merged_chunks(result["stored"])
    assert chunks and all("/c/" in n for n in chunks), chunks


def test_default_names_agree(tmp_path: Path) -> None:
    result = _run(tmp_path / "ckpt", {})
    chunks = _merged_chunks(result["stored"])
    assert chunks and all("/c." in n and "/c/" not in n for n in chunks), chunks  # format 4's keys
    assert any(n.startswith("step_1/optim/tp0.pp0/buf0/bucket0/param/") for n in result["stored"])
    assert "step_1/merged/_ckptd/MERGED" in result["stored"]
    assert "merged/optimizer.state.exp_avg.layers.fc1" in result["merged_arrays"]


@pytest.mark.parametrize("names", [RENAMED], ids=["renamed"])
def test_renamed_prefixes_still_agree(tmp_path: Path, names: dict[str, str]) -> None:
    result = _run(tmp_path / "ckpt", names)
    stored = result["stored"]
    assert any(n.startswith("step_1/opt.state/tp0.pp0/buf0/bucket0/main/") for n in stored)
    assert "step_1/resharded/_ckptd/DONE" in stored
    assert any(n.startswith("step_1/resharded/_ckptd/_prog/") for n in stored)
    assert "resharded/opt.st.exp_avg.layers.fc1" in result["merged_arrays"]
    leaked = [n for n in stored if any(old in n for old in DEFAULT_SPELLINGS)]
    assert not leaked, leaked
