"""The checks a reader makes before it trusts a manifest (docs/format.md, "Manifest checksums"): every
manifest ends with the crc32c of its bytes, which decoding checks (one without it, written by an older
release, is read as before); chunk records must fit their array's geometry; and the read paths that place
bytes by a record's ``nbytes``, or copy a kept shard out of the arena, refuse records that do not fit."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from ckptd.client import chunkio
from ckptd.client.protocol import RestoreShard
from ckptd.client.restore import ArenaSource
from ckptd.writer import checksum, manifests
from ckptd.writer import format as fmt
from ckptd.writer.arrays import _read_raw_chunk
from ckptd.writer.checksum import crc32c
from ckptd.writer.errors import CorruptCheckpointError, UnsupportedFormatError


def _record(name: str, dtype: str, shape: list[int], chunks: list[int], coords: list[list[int]],
            nbytes: list[int] | None = None, pieces: bytes = b"") -> fmt.ArrayRecord:
    item = fmt.itemsize(dtype)
    sizes = nbytes or [int(np.prod(chunks)) * item] * len(coords)
    records = [fmt.ChunkRecord(c, n, 7, pieces) for c, n in zip(coords, sizes, strict=True)]
    return fmt.ArrayRecord(name, dtype, shape, chunks, [fmt.ShardRecord(0, [0] * len(shape), shape, records)],
                           separator=fmt.CHUNK_SEPARATOR)


def _commit(*arrays: fmt.ArrayRecord, step: int = 3) -> fmt.CommitManifest:
    return fmt.CommitManifest(fmt.FORMAT_VERSION, step, 1, 1, list(arrays), {"0": {"lr": 0.1}}, 0, 12.5, [""])


GOOD = _record("w", "float32", [10, 3], [4, 3], [[0, 0], [1, 0], [2, 0]])


# --- the seal -----------------------------------------------------------------------------------------
def test_a_manifest_is_sealed_plain_json_and_every_changed_byte_is_caught() -> None:
    commit = _commit(GOOD)
    data = fmt.encode_json(commit)
    doc = json.loads(data)  # still one plain JSON object
    assert re.fullmatch("[0-9a-f]{8}", doc["crc32c"])
    assert data.endswith(b',"crc32c":"%s"}' % doc["crc32c"].encode())
    assert int(doc["crc32c"], 16) == crc32c(msgspec.json.encode(commit))
    assert manifests.decode_commit_checked(data, "step 3: COMMITTED") == commit
    assert checksum.check_seal(data, "m") is True
    for changed in (data.replace(b'"lr":0.1', b'"lr":0.9'), data.replace(b'"step":3', b'"step":4'),
                    data[:-3] + (b"0" if data[-3:-2] != b"0" else b"1") + data[-2:]):
        with pytest.raises(CorruptCheckpointError, match="crc32c"):
            manifests.decode_commit_checked(changed, "step 3: COMMITTED")


def test_a_manifest_rewritten_by_a_json_tool_is_refused() -> None:
    doc = json.loads(fmt.encode_json(_commit(GOOD)))
    doc["objects"]["0"]["lr"] = 0.9
    for text in (json.dumps(doc), json.dumps(doc, indent=2), json.dumps(doc, separators=(",", ":")) + "\n"):
        with pytest.raises(CorruptCheckpointError, match="not as ckptd wrote it"):
            manifests.decode_commit_checked(text.encode(), "step 3: COMMITTED")


def test_part_manifests_are_sealed_too() -> None:
    part = fmt.PartManifest(fmt.FORMAT_VERSION, 3, 0, 1, 1, [0], [GOOD], {"0": {"lr": 0.1}}, 0, 1.0, attempt="a.1")
    data = fmt.encode_json(part)
    assert "crc32c" in json.loads(data) and manifests.decode_part_checked(data, "node-0.json") == part
    with pytest.raises(CorruptCheckpointError, match="crc32c"):
        manifests.decode_part_checked(data.replace(b'"lr":0.1', b'"lr":0.2'), "node-0.json")


def test_an_unsealed_manifest_of_an_older_release_still_reads_but_its_records_are_checked() -> None:
    old = msgspec.json.encode(_commit(GOOD))  # as releases before the seal wrote it
    assert checksum.check_seal(old, "m") is False and manifests.decode_commit_checked(old, "m") == _commit(GOOD)
    bad = msgspec.json.encode(_commit(_record("w", "float32", [10, 3], [4, 3], [[0, 0], [1, 0], [3, 0]])))
    with pytest.raises(CorruptCheckpointError, match=r"chunk \[3, 0\] lies outside the chunk grid \[3, 1\]"):
        manifests.decode_commit_checked(bad, "step 3: COMMITTED")
    newer = msgspec.json.encode(msgspec.structs.replace(_commit(GOOD), format=fmt.FORMAT_VERSION + 1))
    with pytest.raises(UnsupportedFormatError):
        manifests.decode_commit_checked(checksum.seal_json(newer), "step 3: COMMITTED")


# --- chunk records --------------------------------------------------------------------------------------
def _with(rec: fmt.ArrayRecord, i: int, **change: Any) -> fmt.ArrayRecord:
    """``rec`` with chunk ``i`` of its one shard changed."""
    [shard] = rec.shards
    chunks = list(shard.chunks)
    chunks[i] = msgspec.structs.replace(chunks[i], **change)
    return msgspec.structs.replace(rec, shards=[msgspec.structs.replace(shard, chunks=chunks)])


CUT = _record("w", "float32", [10, 3], [4, 3], [[0, 0], [1, 0], [2, 0]], [48, 48, 24])  # format 2: edge cut
B16 = _record("b", "bfloat16", [5, 7], [2, 3], [[i, j] for i in range(3) for j in range(3)])  # cut on 2 axes
B16_CUT = _record("b", "bfloat16", [5, 7], [2, 3], [[i, j] for i in range(3) for j in range(3)],
                  [[2, 2, 1][i] * [3, 3, 1][j] * 2 for i in range(3) for j in range(3)])
SCALAR = _record("s", "float64", [], [], [[]])
PIECES = _record("p", "uint8", [3 << 20], [3 << 20], [[0]], pieces=b"\0" * 12)  # 3 pieces of 1 MiB


@pytest.mark.parametrize(("good", "bad"), [
    (GOOD, _with(GOOD, 2, nbytes=36)),  # the edge chunk stored whole (formats 3, 4): 48, or cut: 24
    (CUT, _with(CUT, 2, nbytes=28)),
    (B16, _with(B16, 8, coords=[3, 2])),
    (B16_CUT, _with(B16_CUT, 8, nbytes=4)),  # [2, 2]: 1 x 1 elements inside the array (2 bytes), or 12 whole
    (SCALAR, msgspec.structs.replace(SCALAR, shards=[SCALAR.shards[0], SCALAR.shards[0]])),
    (_record("e", "float32", [0], [1], []), _record("e", "float32", [0], [1], [[0]])),  # zero-size: no chunks
    (PIECES, _with(PIECES, 0, pieces=b"\0" * 16)),
])
def test_chunk_records_are_taken_exactly_when_they_fit(good: fmt.ArrayRecord, bad: fmt.ArrayRecord) -> None:
    assert manifests.decode_commit_checked(fmt.encode_json(_commit(good)), "step 3: COMMITTED").arrays == [good]
    with pytest.raises(CorruptCheckpointError, match=f"array {good.name}: chunk"):
        manifests.decode_commit_checked(fmt.encode_json(_commit(bad)), "step 3: COMMITTED")


@pytest.mark.parametrize(("rec", "why"), [
    (_record("w", "float32", [10, 3], [4, 3], [[0, 0], [1, 0], [2, 1]]), r"\[2, 1\] lies outside"),
    (_record("w", "float32", [10, 3], [4, 3], [[0, 0], [-1, 0], [2, 0]]), r"\[-1, 0\] lies outside"),
    (_record("w", "float32", [10, 3], [4, 3], [[0, 0], [1], [2, 0]]), r"\[1\] lies outside"),
    (_record("w", "float32", [10, 3], [4, 3], [[0, 0], [1, 0], [0, 0]]), r"\[0, 0\] is listed twice"),
    (_record("s", "float64", [], [], [[], []]), r"\[\] is listed twice"),
    # the chunk shape changed under the records ([4, 3] -> [2, 3]): a whole chunk is 24 bytes, not 48
    (_record("w", "float32", [10, 3], [2, 3], [[0, 0], [1, 0], [2, 0]], [48, 48, 48]), "records 48 bytes"),
    # an edge chunk neither whole (48) nor cut (24)
    (_record("w", "float32", [10, 3], [4, 3], [[0, 0], [1, 0], [2, 0]], [48, 48, 36]), r"48 \(24 inside"),
    (_record("p", "uint8", [3 << 20], [3 << 20], [[0]], pieces=b"\0" * 8), "2 piece checksums"),
    (_record("w", "float32", [10, 3], [4], [[0, 0]]), "does not fit shape"),
])
def test_chunk_records_that_do_not_fit_are_corrupt(rec: fmt.ArrayRecord, why: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=why):
        manifests.decode_commit_checked(fmt.encode_json(_commit(rec)), "step 3: COMMITTED")


def test_a_raw_chunk_of_neither_size_is_refused_where_a_read_decides_by_size() -> None:
    ext = (slice(8, 10), slice(0, 3))
    assert chunkio.stored_shape("k", 48, [4, 3], ext, 4) == (4, 3)  # whole (format 3)
    assert chunkio.stored_shape("k", 24, [4, 3], ext, 4) == (2, 3)  # cut (format 2)
    with pytest.raises(CorruptCheckpointError, match="k: the manifest records 36 bytes"):
        chunkio.stored_shape("k", 36, [4, 3], ext, 4)


# --- reads that trusted counts ---------------------------------------------------------------------------
class _ShortReads:
    """A backend whose ranged read fills the buffers but reports fewer bytes than asked (a body cut short
    whose Content-Range still names the whole object)."""

    local_root = None

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def read_into(self, key: str, start: int, bufs: list[memoryview]) -> tuple[int, int]:
        pos = 0
        for b in bufs:
            b[:] = self.body[pos : pos + b.nbytes]
            pos += b.nbytes
        return pos - 4, len(self.body)

    def error(self, exc: BaseException) -> BaseException:
        return exc


def test_a_short_raw_chunk_read_is_corrupt() -> None:
    data = np.arange(16, dtype=np.float32)
    crc = crc32c(data.data)
    body = data.tobytes() + crc.to_bytes(4, "little")
    dst = np.zeros(16, dtype=np.float32)
    with pytest.raises(CorruptCheckpointError, match=r"read 64 of 68 bytes of step_1/x/c\.0"):
        asyncio.run(_read_raw_chunk(_ShortReads(body), "step_1/x/c.0", "x",  # type: ignore[arg-type]
                                    fmt.ChunkRecord([0], 64, crc), dst.data.cast("B")))


def test_a_kept_shard_whose_chunks_do_not_cover_it_is_not_copied_from_memory() -> None:
    data = np.arange(8, dtype=np.float32)
    arena = memoryview(bytearray(data.tobytes()))
    rec = fmt.ArrayRecord("x", "float32", [8], [4], [], separator=fmt.CHUNK_SEPARATOR)
    half = fmt.ShardRecord(0, [0], [8], [fmt.ChunkRecord([0], 16, crc32c(data[:4].data))])  # chunk [1] lost
    whole = fmt.ShardRecord(0, [0], [8], [*half.chunks, fmt.ChunkRecord([1], 16, crc32c(data[4:].data))])
    hit = RestoreShard(key="x", global_offset=[0], shape=[8], dtype="float32", offset=0, nbytes=32)
    source = ArenaSource(1, arena, {})
    dst = torch.full((8,), -1.0)
    assert not source.copy_checked(rec, dst, (0,), hit, half)  # half of it would go unchecked: storage reads it
    assert source.copy_checked(rec, dst, (0,), hit, whole) and torch.equal(dst, torch.from_numpy(data))
