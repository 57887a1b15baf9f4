"""A load never hands training a manifest byte it did not check, on steps saved by a real daemon: a changed
byte of ``COMMITTED`` (or of a merge or part manifest) fails its checksum; an older release's manifest (no
checksum) with chunk records that do not fit the array is refused instead of placing checked bytes at the
wrong offsets; a ``COMMITTED`` of another step is not this step's; and ``ckptd verify`` reports all of
these, and a layout sidecar the commit names that is missing or damaged, as corrupt (exit 1)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.fastread import ChunkReader
from ckptd.client.protocol import StepState
from ckptd.client.reader import load, read_commit
from ckptd.daemon.cli import main
from ckptd.daemon.offline import EXIT_CORRUPT
from ckptd.testing.launch import DaemonProcess
from ckptd.writer import format as fmt
from ckptd.writer.arrays import verify_array
from ckptd.writer.errors import CorruptCheckpointError
from ckptd.writer.root import open_root

pytestmark = pytest.mark.timeout(180)
LAYOUT = json.dumps({"buffers": [], "note": "a layout sidecar"})


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 128, generator=g), "b": torch.randn(10, generator=g),
            "opt": {"lr": 0.1 * step, "step": step}, "megatron": {"layout": fmt.sidecar_name(LAYOUT)}}


@pytest.fixture(scope="module")
def saved(module_sockdir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Steps 1 and 2 saved by a daemon (64 KiB chunks: ``w`` is two chunks of [128, 128]), step 1 naming a
    layout sidecar as a Megatron save does."""
    root = str(tmp_path_factory.mktemp("saved") / "ckpt")
    d = DaemonProcess(root, os.path.join(module_sockdir, "d.sock"), "--arena-size", "16MiB", "--no-prefault",
                      "--chunk-bytes", "64KiB").wait_ready()
    try:
        client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), timeout_s=30)
        for step in (1, 2):
            assert client.save(step, _state(step), sidecars=[LAYOUT]).wait(60).state is StepState.COMMITTED
        client.close()
    finally:
        d.stop(timeout=20)
    yield root


@pytest.fixture
def root(saved: str, tmp_path: Path) -> str:
    copy = str(tmp_path / "ckpt")
    shutil.copytree(saved, copy)
    return copy


def _marker(root: str, step: int = 1) -> Path:
    return Path(root, fmt.commit_marker(step))


def _load(root: str, step: int = 1) -> dict[str, Any]:
    return load(root, step, {"w": torch.zeros(256, 128), "b": torch.zeros(10)})


def _verify(root: str, capsys: pytest.CaptureFixture[str], step: int = 1) -> tuple[int, str]:
    rc = main(["verify", root, "--step", str(step)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_a_changed_byte_of_the_commit_manifest_fails_the_load_and_verify(root: str, capsys) -> None:
    out = _load(root)
    assert out["opt"]["lr"] == 0.1 and torch.equal(out["w"], _state(1)["w"])
    assert _verify(root, capsys)[0] == 0
    marker = _marker(root)
    data = marker.read_bytes()
    assert data.count(b'"lr":0.1') == 1
    marker.write_bytes(data.replace(b'"lr":0.1', b'"lr":0.9'))
    with pytest.raises(CorruptCheckpointError, match=r"step 1: COMMITTED .* is damaged: its bytes have crc32c"):
        _load(root)
    assert "crc32c" in json.loads(data)  # plain JSON, sealed
    rc, text = _verify(root, capsys)
    assert rc == EXIT_CORRUPT and "is damaged: its bytes have crc32c" in text
    doc = json.loads(data)  # the same change through a JSON tool
    doc["objects"]["0"]["opt"]["lr"] = 0.9
    marker.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="not as ckptd wrote it"):
        _load(root)


def test_chunk_records_that_do_not_fit_the_array_are_refused(root: str, capsys) -> None:
    marker = _marker(root)
    doc = json.loads(marker.read_bytes())
    doc.pop("crc32c", None)  # as a release before the checksum wrote it: read unchecked, as before
    marker.write_bytes(msgspec.json.encode(doc))
    assert torch.equal(_load(root)["w"], _state(1)["w"]) and _verify(root, capsys)[0] == 0
    [w] = [a for a in doc["arrays"] if a["name"] == "w"]
    assert w["chunks"] == [128, 128]
    w["chunks"] = [64, 128]  # rows 64..127 would come from the chunk holding rows 128..191
    marker.write_bytes(msgspec.json.encode(doc))
    with pytest.raises(CorruptCheckpointError, match=r"array w: chunk \[0, 0\] records 65536 bytes"):
        load(root, 1, {"w": Shard("w", torch.zeros(128, 128), (256, 128), (0, 0))})  # a rank's half of it
    rc, text = _verify(root, capsys)
    assert rc == EXIT_CORRUPT and "array w: chunk [0, 0] records 65536 bytes" in text
    w["chunks"] = [128, 128]
    w["shards"][0]["chunks"][1]["coords"] = [0, 0]  # the same chunk twice, the other one lost
    marker.write_bytes(msgspec.json.encode(doc))
    with pytest.raises(CorruptCheckpointError, match=r"chunk \[0, 0\] is listed twice"):
        _load(root)


def test_reads_by_a_record_of_another_chunk_shape_are_refused(root: str) -> None:
    """Where a commit object reaches the readers without :meth:`CheckpointRoot.read_commit`'s checks."""
    commit = read_commit(root, 1)
    arrays = [msgspec.structs.replace(a, chunks=[64, 128]) if a.name == "w" else a for a in commit.arrays]
    doctored = msgspec.structs.replace(commit, arrays=arrays)
    [rec] = [a for a in arrays if a.name == "w"]

    async def go() -> None:
        async with open_root(root) as ckpt:
            reader = ChunkReader(ckpt, doctored)
            with pytest.raises(CorruptCheckpointError, match="neither a whole chunk of"):
                reader.add("w", torch.zeros(128, 128), (0, 0))
                await reader.run()
            with pytest.raises(CorruptCheckpointError, match=r"chunks \(128, 128\).* records .*\(64, 128\)"):
                await verify_array(ckpt.store, fmt.step_dir(1), rec)  # the array's document disagrees first

    asyncio.run(go())


def test_a_commit_manifest_of_another_step_is_not_this_steps(root: str, capsys) -> None:
    shutil.copy(_marker(root, 2), _marker(root, 1))
    with pytest.raises(CorruptCheckpointError, match=r"step 1: its COMMITTED .* is the manifest of step 2"):
        _load(root)
    rc, text = _verify(root, capsys)
    assert rc == EXIT_CORRUPT and "is the manifest of step 2" in text


def test_merge_and_part_manifests_are_checked(root: str, capsys) -> None:
    merged = Path(root, fmt.merged_marker(1))
    merged.parent.mkdir(parents=True)
    data = _marker(root).read_bytes()  # a merge manifest has the commit's schema
    merged.write_bytes(data)

    async def read() -> Any:
        async with open_root(root) as ckpt:
            return await ckpt.read_merged_manifest(1), await ckpt.read_parts(1)

    manifest, parts = asyncio.run(read())
    assert manifest is not None and manifest.step == 1 and list(parts) == [0]
    merged.write_bytes(data.replace(b'"lr":0.1', b'"lr":0.5'))
    with pytest.raises(CorruptCheckpointError, match=r"merge manifest .* is damaged"):
        asyncio.run(read())
    rc, text = _verify(root, capsys)
    assert rc == EXIT_CORRUPT and "merge manifest" in text
    merged.unlink()
    part = Path(root, fmt.part_key(1, 0))
    part.write_bytes(part.read_bytes().replace(b'"lr":0.1', b'"lr":0.5'))
    with pytest.raises(CorruptCheckpointError, match=r"node-0\.json .* is damaged .* crc32c"):
        asyncio.run(read())


def test_verify_reads_the_layout_sidecars_the_commit_names(root: str, capsys) -> None:
    sidecar = Path(root, fmt.sidecar_key(fmt.sidecar_name(LAYOUT)))
    assert sidecar.read_text() == LAYOUT
    raw = sidecar.read_bytes()
    sidecar.write_bytes(raw[:2] + bytes([raw[2] ^ 0x80]) + raw[3:])  # no longer UTF-8
    with pytest.raises(CorruptCheckpointError, match="does not match its hash"):
        asyncio.run(_read_sidecar(root))
    rc, text = _verify(root, capsys)
    assert rc == EXIT_CORRUPT and "does not match its hash (layout sidecar of rank(s) 0)" in text
    sidecar.unlink()
    rc, text = _verify(root, capsys)
    assert rc == EXIT_CORRUPT and f"layout sidecar {sidecar.name} of rank(s) 0 is missing" in text
    assert _verify(root, capsys, step=2)[0] == EXIT_CORRUPT  # step 2 names it too


async def _read_sidecar(root: str) -> str:
    async with open_root(root) as ckpt:
        return await ckpt.read_sidecar(fmt.sidecar_name(LAYOUT))


def test_an_array_document_missing_or_of_another_array_is_corruption(root: str, capsys) -> None:
    """A committed array's ``zarr.json`` is part of the checkpoint: gone, verify said "unreadable" (fix access
    and run again); another array's in its place (int32 over float32 of the same size), verify said OK while
    zarr readers got other numbers. Both are now corruption, named, against the commit manifest."""
    doc = Path(root, fmt.step_dir(1), "w", "zarr.json")
    meta = json.loads(doc.read_text())
    meta["data_type"] = "int32"
    doc.write_text(json.dumps(meta))
    rc, text = _verify(root, capsys)
    assert rc == EXIT_CORRUPT and "w: its zarr.json says dtype int32" in text and "records float32" in text
    doc.write_text(json.dumps(meta)[:40])  # cut short: not "unreadable" (fix access), corrupt
    rc, text = _verify(root, capsys)
    assert rc == EXIT_CORRUPT and "w: its zarr.json does not decode" in text
    doc.unlink()
    rc, text = _verify(root, capsys)
    assert rc == EXIT_CORRUPT and "w: its zarr.json is missing or not an array's" in text
