"""The fast read path (ckptd.client.fastread): raw chunks read straight into tensors, bit-exact for whole
and partial chunks (a partial one read piece by piece for every region in it), edge chunks, bfloat16 and
non-contiguous destinations; a corrupted, truncated or missing chunk raises CorruptCheckpointError. Steps
are written by the real writer (no daemon). The same on S3 (a moto server on 127.0.0.1): ranged GETs read
straight into the tensors, in parts that split chunks and their trailers. Strided regions of 1-D arrays
(``add_gather``, a TP half of a row-parallel param): bit-exact, each chunk read once and checksummed
whole, chunks holding none of their elements not read."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import pytest
import torch

from ckptd.client.chunkio import Job, read_local
from ckptd.client.fastread import ChunkReader
from ckptd.client.gather import Strided
from ckptd.client.reader import load, read_commit, read_flat
from ckptd.client.state import Shard
from ckptd.testing.fixtures import BUCKET, commit_one_node
from ckptd.testing.s3server import S3Server
from ckptd.writer import format as fmt
from ckptd.writer.arrays import (
    ChunkSink,
    array_metadata,
    checksum,
    full_chunk,
    open_for_write,
    verify_array,
    write_metadata,
)
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import CorruptCheckpointError, StateMismatchError, StorageError, StoragePermissionError
from ckptd.writer.progress import ByteProgress
from ckptd.writer.root import open_root

# name -> (tensor, rows per chunk)
G = torch.Generator().manual_seed(0)
ARRAYS = {
    "w": (torch.randn(7, 5, generator=G), 2),  # edge chunk of 1 row
    "b16": (torch.randn(9, generator=G).to(torch.bfloat16), 4),
    "flat": (torch.arange(100, dtype=torch.float32), 25),
}


def _write(root: str, options: dict[str, object] | None = None,
           arrays: dict[str, tuple[torch.Tensor, int]] = ARRAYS) -> None:
    async def go() -> None:
        async with await open_backend(root, options, create=True) as backend:
            ckpt, sink = CheckpointWriter(backend), ChunkSink(backend)
            records = []
            for key, (t, rows) in arrays.items():
                shape, grid = list(t.shape), [rows, *t.shape[1:]]
                chunks = []
                for i in range(-(-shape[0] // rows)):
                    block = t[i * rows : (i + 1) * rows]
                    bits = block.view(torch.int16) if t.dtype == torch.bfloat16 else block
                    coords = [i] + [0] * (len(shape) - 1)
                    crc, pieces = await sink.put(f"step_1/{key}/{fmt.chunk_key(coords, '/')}", bits.numpy())
                    chunks.append(fmt.ChunkRecord(coords, block.numel() * block.element_size(), crc, pieces))
                shard = fmt.ShardRecord(0, [0] * len(shape), shape, chunks)
                # chunk keys as formats 1-3 wrote them (c/<i>/<j>); the daemon-written steps of the integration tests
                # have format 4's (c.<i>.<j>)
                records.append(fmt.ArrayRecord(key, str(t.dtype).removeprefix("torch."), shape, grid, [shard],
                                               separator="/"))
            await commit_one_node(ckpt, 1, records)

    asyncio.run(go())


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("fastread") / "ckpt")
    _write(path)
    return path


def test_whole_and_partial_regions_are_bit_exact(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w, b16, flat = (ARRAYS[k][0] for k in ("w", "b16", "flat"))
    out = load(root, 1, {"w": torch.zeros(7, 5), "b16": torch.zeros(9, dtype=torch.bfloat16)})
    assert torch.equal(out["w"], w) and torch.equal(out["b16"].view(torch.int16), b16.view(torch.int16))
    # rows 1..6 cut chunks 0 and 3; a column-sliced (non-contiguous) destination

    part = torch.zeros(5, 3)
    dst = torch.zeros(5, 6)[:, 1:4]
    load(root, 1, {"p": Shard("w", part, (7, 5), (1, 2)), "q": Shard("w", dst, (7, 5), (1, 2))})
    assert torch.equal(part, w[1:6, 2:5]) and torch.equal(dst, w[1:6, 2:5])
    # a chunk a region holds part of is read once for every region in it, piece by piece (no buffer of a
    # whole chunk): rows 1-5 touch chunks 0-2 (2 rows each), both regions in each; rows 2-3, which a third
    # region holds whole (chunk 1), are read with them, not a second time
    from ckptd.client import fastread

    reads: list[str] = []

    def counted(path: str, job: Job) -> None:
        reads.append(job.path)
        read_local(path, job)

    monkeypatch.setattr(fastread, "read_local", counted)
    dsts = [torch.zeros(5, 3), torch.zeros(5, 6)[:, 1:4], torch.zeros(2, 5)]

    async def planned_and_read() -> tuple[list[str], list[int], list[Job]]:
        async with open_root(root, None, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1))
            for dst, offset in zip(dsts, [(1, 2), (1, 2), (2, 0)], strict=True):
                reader.add("w", dst, offset)
            reader._carve_staged()  # the strided view's staging is planned when the round starts
            planned = sorted(reader.gathers), [len(j.gather or []) for j in reader.gathers.values()], reader.jobs
            await reader.run()
            return planned

    gathers, regions, direct = asyncio.run(planned_and_read())
    assert gathers == [f"step_1/w/c/{i}/0" for i in range(3)] and regions == [2, 2, 2]
    assert [job.path for job in direct] == ["step_1/w/c/1/0"] and direct[0].direct is not None  # as planned ...
    assert sorted(reads) == gathers  # ... but read once, with the gather job
    assert all(torch.equal(d, w[1:6, 2:5]) for d in dsts[:2]) and torch.equal(dsts[2], w[2:4])
    # 1-D regions clipped to the stored length, starting inside a chunk
    got = read_flat(root, read_commit(root, 1), {"flat": (30, 130), "b16": (3, 4)})
    assert torch.equal(got["flat"], flat[30:]) and torch.equal(got["b16"].view(torch.int16), b16[3:4].view(torch.int16))


def test_a_load_and_verify_report_every_byte_they_checked(root: str) -> None:
    """What the progress of a load (logged past 30 s) and of ``ckptd verify`` counts: every chunk once."""

    async def go() -> tuple[ByteProgress, list[int], int, torch.Tensor]:
        async with open_root(root, None, create=False) as ckpt:
            commit = await ckpt.read_commit(1)
            reader = ChunkReader(ckpt, commit)
            reader.progress = ByteProgress("load of step 1", every_s=3600)
            out = torch.zeros(100)
            reader.add("flat", out, (0,))
            await reader.run()
            chunks: list[int] = []
            rec = next(r for r in commit.arrays if r.name == "flat")
            return reader.progress, chunks, await verify_array(ckpt.store, fmt.step_dir(1), rec, chunks.append), out

    progress, chunks, verified, out = asyncio.run(go())
    assert torch.equal(out, ARRAYS["flat"][0]) and progress.done == progress.total == 400
    assert chunks == [100] * 4 and verified == 400


@pytest.mark.parametrize("device", [False, True], ids=["host-views", "device-stand-in"])
def test_staged_regions_are_read_in_rounds_within_the_staging_bound(
    root: str, monkeypatch: pytest.MonkeyPatch, host_buffers: list[tuple[int, bool]], device: bool
) -> None:
    """Destinations a load cannot read into (another device's tensors; here non-contiguous views) are staged in
    host memory: at most ``stage_bytes`` at a time, split into blocks of rows and read in rounds, each round
    copied into place before the next, every round in the same host buffer (one allocation for the whole
    load), sized to the largest round the load has, not to the bound, and asked page-locked only when a
    destination is a GPU's (``device-stand-in``: the views stand in for CUDA tensors). Bit-exact either way;
    the default stages them all in one round."""
    from ckptd.client import fastread
    from ckptd.client.stagepool import ALIGN

    if device:
        monkeypatch.setattr(fastread, "pinnable", lambda t: True)
    w = ARRAYS["w"][0]

    def destinations() -> list[tuple[torch.Tensor, tuple[int, int]]]:
        return [(torch.zeros(7, 10)[:, ::2], (0, 0)),  # 140 bytes, every element strided
                (torch.zeros(5, 6)[:, 1:4], (1, 2))]  # 60 bytes, rows 1-5 x columns 2-4

    async def read(stage_bytes: int | None) -> tuple[list[tuple[torch.Tensor, tuple[int, int]]], int, int]:
        dsts = destinations()
        async with open_root(root, None, create=False) as ckpt:
            kw = {} if stage_bytes is None else {"stage_bytes": stage_bytes}
            reader = ChunkReader(ckpt, await ckpt.read_commit(1), **kw)
            for dst, offset in dsts:
                reader.add("w", dst, offset)
            planned = reader.staged_bytes
            await reader.run()
            assert not reader.deferred and not reader.copies
            assert reader.staging.allocations == 1  # every round reused the pool's buffer
            return dsts, planned, reader.peak_staged_bytes

    for stage_bytes, first_round, peak, regions in ((None, 200, 200, 2), (40, 40, 40, 6)):
        host_buffers.clear()
        dsts, planned, seen = asyncio.run(read(stage_bytes))
        assert (planned, seen) == (first_round, peak)
        assert torch.equal(dsts[0][0], w) and torch.equal(dsts[1][0], w[1:6, 2:5])
        # one buffer: the largest round (all 200 bytes, or the 40-byte bound) and each region's alignment
        size = peak + ALIGN * regions
        assert host_buffers == [(1 << (size - 1).bit_length() if device else size, device)]


@pytest.mark.gpu
def test_cuda_destinations_are_staged_in_rounds_and_bit_exact(root: str) -> None:
    """The same on a GPU: CUDA tensors (contiguous, and a strided view) read through host staging in rounds
    of at most ``stage_bytes``, one host buffer for all rounds, then copied to the device."""
    assert torch.cuda.is_available()
    w, flat = ARRAYS["w"][0], ARRAYS["flat"][0]

    async def read() -> tuple[torch.Tensor, torch.Tensor, ChunkReader]:
        whole, strided = torch.zeros(7, 5, device="cuda"), torch.zeros(100, 2, device="cuda")[:, 1]
        async with open_root(root, None, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1), stage_bytes=64)
            reader.add("w", whole, (0, 0))
            reader.add("flat", strided, (0,))
            await reader.run()
        return whole, strided, reader

    whole, strided, reader = asyncio.run(read())
    assert torch.equal(whole.cpu(), w) and torch.equal(strided.cpu(), flat)
    assert reader.peak_staged_bytes <= 64 and reader.staging.allocations == 1 and reader.staging.pinned


@pytest.mark.parametrize("staged_first", [False, True])
def test_a_staged_and_a_direct_region_in_one_chunk_are_both_filled(root: str, staged_first: bool) -> None:
    """Two regions of one chunk of a 1-D array in one round: one read straight into a host tensor (a bucket
    slice), one staged for another device's tensor (a ``meta`` tensor stands in for a GPU's; what reaches it
    is the staging, watched here). Their gather job is shared, in one numbering of the chunk's elements,
    whichever region comes first."""
    flat = ARRAYS["flat"][0]

    async def go() -> tuple[torch.Tensor, list[torch.Tensor]]:
        direct, device = torch.full((10,), -1.0), torch.empty(10, device="meta")
        adds = [(direct, (30,)), (device, (40,))]  # both in chunk 1 (elements 25..49), neither whole
        async with open_root(root, None, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1))
            staged: list[torch.Tensor] = []
            take = reader.staging.take

            def watched(dst: torch.Tensor) -> torch.Tensor:
                buf = take(dst)
                buf.fill_(-1.0)
                staged.append(buf)
                return buf

            reader.staging.take = watched  # type: ignore[method-assign]
            for dst, offset in reversed(adds) if staged_first else adds:
                reader.add("flat", dst, offset)
            await reader.run()
        return direct, staged

    direct, staged = asyncio.run(go())
    assert torch.equal(direct, flat[30:40]) and len(staged) == 1 and torch.equal(staged[0], flat[40:50])


def _write_zstd(root: str, t: torch.Tensor, rows: int) -> None:
    """A committed step with one zstd-compressed 1-D array (as ``--codec zstd`` writes), edge chunk padded."""

    async def go() -> None:
        async with await open_backend(root, None, create=True) as backend:
            n = t.numel()
            meta = await array_metadata("float32", [n], [rows], codec="zstd", separator="/")
            await write_metadata(backend.store, "step_1/z", meta)
            await open_for_write(backend.store, "step_1/z", meta).setitem(slice(None), t.numpy())
            blocks = [full_chunk(t.numpy()[i : i + rows], [rows]) for i in range(0, n, rows)]
            chunks = [fmt.ChunkRecord([i], b.nbytes, await checksum(b)) for i, b in enumerate(blocks)]
            rec = fmt.ArrayRecord("z", "float32", [n], [rows], [fmt.ShardRecord(0, [0], [n], chunks)], codec="zstd",
                                  separator="/")
            writer = CheckpointWriter(backend)
            await commit_one_node(writer, 1, [rec])

    asyncio.run(go())


def test_compressed_chunks_are_checked_against_the_manifest(tmp_path: Path) -> None:
    """zarr reads a missing chunk as zeros and any valid chunk as what it holds: the compressed path checks
    each chunk it reads for presence, size and the manifest's crc32c, like the raw path."""
    t = torch.arange(1, 111, dtype=torch.float32)  # 5 chunks of 25, the last an edge chunk of 10
    good = str(tmp_path / "good")
    _write_zstd(good, t, 25)
    assert torch.equal(load(good, 1, {"z": torch.zeros(110)})["z"], t)
    part = torch.zeros(55)
    load(good, 1, {"z": Shard("z", part, (110,), (30,))})  # cuts chunks 1 and 3
    assert torch.equal(part, t[30:85])
    for damage in ("remove", "another chunk"):
        bad = str(tmp_path / damage.replace(" ", "-"))
        shutil.copytree(good, bad)
        chunk2 = os.path.join(bad, "step_1", "z", "c", "2")
        if damage == "remove":
            os.remove(chunk2)
        else:  # a valid zstd chunk with its own trailer, holding other data
            shutil.copy(os.path.join(bad, "step_1", "z", "c", "1"), chunk2)
        with pytest.raises(CorruptCheckpointError, match=r"z: chunk \[2\]"):
            load(bad, 1, {"z": torch.zeros(110)})
        rest = torch.zeros(20)
        load(bad, 1, {"z": Shard("z", rest, (110,), (80,))})  # chunks 3 and 4 are intact
        assert torch.equal(rest, t[80:100])


def test_a_failed_ranged_load_raises_once_no_check_still_writes(root: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The object-store path: one chunk fails its check while another chunk's check (which copies its
    elements into place) still runs in a pool thread; the load raises only after that thread is done, so
    nothing lands in the caller's tensors after the error (as on the local path)."""
    from ckptd.client import chunkio, ranged

    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    chunk = os.path.join(copy, "step_1", "w", "c", "1", "0")
    data = bytearray(Path(chunk).read_bytes())
    data[5] ^= 0x10
    Path(chunk).write_bytes(bytes(data))

    flat_checking = threading.Event()

    def slow_verify(job: Job, body: memoryview, trailer: bytes, pieces: list[int] | None = None) -> None:
        if "flat" in job.path:
            flat_checking.set()
            time.sleep(0.3)  # the crc of a large chunk on a busy host
        elif job.path.endswith("c/1/0"):
            assert flat_checking.wait(10)  # the damaged chunk fails while the other one is being checked
        chunkio.verify(job, body, trailer, pieces)

    monkeypatch.setattr(ranged, "verify", slow_verify)
    dst = torch.full((10,), -1.0)

    async def go() -> torch.Tensor:
        async with open_root(copy, None, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1))
            reader.local_root = None  # the ranged reads of an object store, here from a local store
            reader.add("flat", dst, (30,))
            reader.add("w", torch.zeros(7, 5), (0, 0))
            with pytest.raises(CorruptCheckpointError, match="c/1/0"):
                await reader.run()
            return dst.clone()

    at_raise = asyncio.run(go())
    time.sleep(0.5)
    assert torch.equal(dst, at_raise)


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_chunk_raises(root: str, tmp_path: Path, damage: str) -> None:

    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    path = os.path.join(copy, "step_1", "w", "c", "1", "0")
    data = bytearray(Path(path).read_bytes())
    if damage == "flip":
        data[5] ^= 0x10
        Path(path).write_bytes(bytes(data))
    elif damage == "truncate":
        Path(path).write_bytes(bytes(data[:-1]))
    else:
        os.remove(path)
    with pytest.raises(CorruptCheckpointError, match="c/1/0"):
        load(copy, 1, {"w": torch.zeros(7, 5)})
    # a region that does not touch the chunk still loads

    part = torch.zeros(2, 5)
    load(copy, 1, {"w": Shard("w", part, (7, 5), (4, 0))})
    assert torch.equal(part, ARRAYS["w"][0][4:6])


def test_a_manifest_missing_a_chunk_raises(root: str) -> None:
    """A commit manifest whose chunk list has a gap (a damaged ``COMMITTED``, a faulty merge: the commit
    checks coverage, the reader must not trust it) raises; the destination's rows were never loaded before."""
    commit = read_commit(root, 1)
    rec = next(r for r in commit.arrays if r.name == "w")
    shard = msgspec.structs.replace(rec.shards[0], chunks=[c for c in rec.shards[0].chunks if c.coords != [1, 0]])
    damaged = msgspec.structs.replace(commit, arrays=[msgspec.structs.replace(rec, shards=[shard])])

    async def go() -> None:
        async with open_root(root, None, create=False) as ckpt:
            reader = ChunkReader(ckpt, damaged)
            reader.add("w", torch.zeros(7, 5), (0, 0))
            await reader.run()

    with pytest.raises(CorruptCheckpointError, match=r"w: chunk \(1, 0\) is not in the manifest"):
        asyncio.run(go())


def test_a_template_shard_of_another_rank_than_its_offset_is_refused(root: str) -> None:
    with pytest.raises(StateMismatchError, match="1 dimension"):  # was zip()'s ValueError
        load(root, 1, {"x": Shard("w", torch.zeros(35), (7, 5), (0, 0))})


def test_a_chunk_the_file_system_refuses_raises_a_typed_error(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``EACCES`` or ``EIO`` from the file system reach the caller as the local backend types them, naming
    the chunk (not a bare ``OSError``). Injected: the tests run as root, whom file modes do not stop."""
    real = os.open

    def refusing(code: int) -> Callable[..., int]:
        def open_(path: str, flags: int, *args: int) -> int:
            if path.endswith(os.path.join("w", "c", "1", "0")):
                raise OSError(code, os.strerror(code), path)  # EACCES: a PermissionError
            return real(path, flags, *args)
        return open_

    monkeypatch.setattr(os, "open", refusing(errno.EACCES))
    with pytest.raises(StoragePermissionError, match="c/1/0"):
        load(root, 1, {"w": torch.zeros(7, 5)})
    monkeypatch.setattr(os, "open", refusing(errno.EIO))
    with pytest.raises(StorageError, match="c/1/0: the chunk could not be read"):
        load(root, 1, {"w": torch.zeros(7, 5)})


def test_a_cancelled_local_load_returns_once_no_thread_writes(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load cancelled (a timeout around it) while its threads read: the cancellation reaches the caller once
    the threads ended their chunks, and none starts another; nothing lands in the tensors afterwards."""
    from ckptd.client import fastread

    begun: list[str] = []

    def slow(path: str, job: Job) -> None:
        begun.append(job.path)
        time.sleep(1.0)
        read_local(path, job)

    monkeypatch.setattr(fastread, "read_local", slow)
    dst = torch.zeros(7, 5)

    async def go() -> torch.Tensor:
        async with open_root(root, None, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1), concurrency=2)
            reader.add("w", dst, (0, 0))
            run = asyncio.create_task(reader.run())
            # cancelled once both threads are in a chunk (a fixed 0.1 s timeout could come before a thread of
            # the pool had begun one on a loaded runner), well before either has read it
            deadline = time.monotonic() + 60
            while len(begun) < 2:
                assert time.monotonic() < deadline and not run.done(), begun
                await asyncio.sleep(0.005)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            return dst.clone()

    at_cancel = asyncio.run(go())
    time.sleep(1.5)
    assert torch.equal(dst, at_cancel)  # before: two more chunks landed after the load had returned
    assert int((at_cancel != 0).any(1).sum()) == 4  # the two chunks the threads had begun (2 rows each), no more


# --- S3: ranged GETs into the destination ----------------------------------------------------------------
def _s3_read(url: str, options: dict[str, object], template: dict[str, Shard], part_bytes: int) -> None:
    async def go() -> None:
        async with open_root(url, options, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1), concurrency=3, part_bytes=part_bytes)
            for shard in template.values():
                reader.add(shard.key, shard.data, shard.global_offset)
            await reader.run()

    asyncio.run(go())


@pytest.mark.s3
def test_s3_ranged_reads_are_bit_exact(s3_options: dict[str, object]) -> None:
    url = f"s3://{BUCKET}/fastread-exact"
    _write(url, s3_options)
    w, b16, flat = (ARRAYS[k][0] for k in ("w", "b16", "flat"))
    for part_bytes in (7, 1 << 20):  # parts that split chunks and their trailers; one GET a chunk
        whole, b = torch.zeros(7, 5), torch.zeros(9, dtype=torch.bfloat16)
        part, cols, tail = torch.zeros(5, 3), torch.zeros(5, 6)[:, 1:4], torch.zeros(70)
        _s3_read(url, s3_options, {"w": Shard("w", whole, (7, 5), (0, 0)), "b": Shard("b16", b, (9,), (0,)),
                                   "p": Shard("w", part, (7, 5), (1, 2)), "q": Shard("w", cols, (7, 5), (1, 2)),
                                   "f": Shard("flat", tail, (100,), (30,))}, part_bytes)
        assert torch.equal(whole, w) and torch.equal(b.view(torch.int16), b16.view(torch.int16))
        assert torch.equal(part, w[1:6, 2:5]) and torch.equal(cols, w[1:6, 2:5]) and torch.equal(tail, flat[30:])
    regions, pairs = _gather_case()  # strided regions: whole chunks fetched, the elements copied out
    _gather(url, regions, s3_options)
    for got, want in zip(pairs[:4], pairs[4:], strict=True):
        assert torch.equal(got, want)


@pytest.mark.s3
def test_s3_damaged_chunks_raise(s3_options: dict[str, object], s3: S3Server) -> None:
    url = f"s3://{BUCKET}/fastread-damaged"
    _write(url, s3_options)
    client = s3.client()
    prefix = url.split("/", 3)[3] + "/step_1/"
    # chunk i of "w" holds rows 2i, 2i+1; chunk 1 of "flat" holds elements 25..49
    damages = {"w/c/0/0": "flip", "w/c/1/0": "flip-trailer", "w/c/2/0": "truncate", "w/c/3/0": "extend",
               "flat/c/1": "remove"}
    for name, damage in damages.items():
        data = bytearray(client.get_object(Bucket=BUCKET, Key=prefix + name)["Body"].read())
        if damage == "remove":
            client.delete_object(Bucket=BUCKET, Key=prefix + name)
            continue
        if damage.startswith("flip"):
            data[1 if damage == "flip" else -1] ^= 0x10
        body = bytes(data[:-1]) if damage == "truncate" else bytes(data) + (b"x" if damage == "extend" else b"")
        client.put_object(Bucket=BUCKET, Key=prefix + name, Body=body)
    regions = {"w/c/0/0": ("w", (0, 0), (2, 5)), "w/c/1/0": ("w", (2, 0), (2, 5)), "w/c/2/0": ("w", (4, 0), (2, 5)),
               "w/c/3/0": ("w", (6, 0), (1, 5)), "flat/c/1": ("flat", (30,), (10,))}
    for name, (key, offset, shape) in regions.items():
        gshape = tuple(ARRAYS[key][0].shape)
        with pytest.raises(CorruptCheckpointError, match=name.split("/", 1)[1]):
            _s3_read(url, s3_options, {"x": Shard(key, torch.zeros(shape), gshape, offset)}, 7)
    ok = torch.zeros(20)  # a region that touches no damaged chunk still loads
    _s3_read(url, s3_options, {"f": Shard("flat", ok, (100,), (55,))}, 7)
    assert torch.equal(ok, ARRAYS["flat"][0][55:75])


# --- strided regions of 1-D arrays (add_gather): each chunk read once, checksummed whole -------------------
def _gather(url: str, regions: list[tuple[str, torch.Tensor, Strided]], options: dict[str, object] | None = None,
            ) -> None:
    async def go() -> None:
        async with open_root(url, options, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1), concurrency=3, part_bytes=7)
            for key, dst, region in regions:
                reader.add_gather(key, dst, region)
            await reader.run()

    asyncio.run(go())


def _gather_case() -> tuple[list[tuple[str, torch.Tensor, Strided]], list[torch.Tensor]]:
    """Every half-row of a (4, 5)-strided box of "flat" (through chunks 0-2, into a non-contiguous
    destination), a run inside chunk 3, chunk 0 of "b16" whole and two strided elements of its chunk 1."""
    flat, b16 = ARRAYS["flat"][0], ARRAYS["b16"][0].view(torch.int16)
    rows = torch.zeros(4, 10)[:, ::2]
    run, whole, pair = torch.zeros(8), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)
    regions = [("flat", rows, Strided(3, (4, 5), (20, 2))), ("flat", run, Strided(92, (8,), (1,))),
               ("b16", whole, Strided(0, (4,), (1,))), ("b16", pair, Strided(5, (2,), (2,)))]
    got = [rows, run, whole.view(torch.int16), pair.view(torch.int16)]
    want = [flat[3:83].view(4, 20)[:, :10:2], flat[92:], b16[:4], b16[5:8:2]]
    assert all(g.abs().sum() == 0 for g in got)
    return regions, [*got, *want]


def test_gathered_regions_are_bit_exact_and_every_read_chunk_is_checked(
    root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptd.client import chunkio, fastread

    monkeypatch.setattr(chunkio, "PIECE", 40)  # pieces that cut rows; runs of >= 8 bytes read into place
    monkeypatch.setattr(fastread, "_RUN", 8)
    regions, pairs = _gather_case()
    _gather(root, regions)
    for got, want in zip(pairs[:4], pairs[4:], strict=True):
        assert torch.equal(got, want)
    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    # a byte no region needs, in a chunk a region reads: caught; in chunk 2 of b16, which no region touches: not read
    for name, pos, raises in (("flat/c/1", 13, True), ("b16/c/2", 1, False)):  # flat[28]: not in the box
        path = os.path.join(copy, "step_1", *name.split("/"))
        data = bytearray(Path(path).read_bytes())
        data[pos] ^= 0x10
        Path(path).write_bytes(bytes(data))
        regions, _pairs = _gather_case()
        if raises:
            with pytest.raises(CorruptCheckpointError, match=name.split("/", 1)[1]):
                _gather(copy, regions)
            Path(path).write_bytes(bytes(data[:pos] + bytes([data[pos] ^ 0x10]) + data[pos + 1 :]))
        else:
            _gather(copy, regions)


def _partial_read_case(url: str, options: dict[str, object] | None, get: Callable[[], bytes],
                       put: Callable[[bytes], None]) -> None:
    """Chunks written with the crc32c of each 40-byte piece (``flat``: 100-byte chunks, pieces of elements
    0-9, 10-19, 20-24; ``get`` and ``put`` read and replace chunk 0's stored object): a gather of elements
    0-4 and 21, 23 reads pieces 0 and 2 of chunk 0 and checks each; damage in piece 1 goes unread, damage
    in piece 2 or 0 names the piece, a trailer that is not the manifest's crc32c names the chunk."""
    _write(url, options)
    flat = ARRAYS["flat"][0]

    def load() -> tuple[torch.Tensor, torch.Tensor]:
        head, odd = torch.zeros(5), torch.zeros(2)
        _gather(url, [("flat", head, Strided(0, (5,), (1,))), ("flat", odd, Strided(21, (2,), (2,)))], options)
        return head, odd

    good = get()
    trailer = "the chunk's trailer says crc32c 0x[0-9a-f]+, the manifest"
    for pos, piece in ((50, None), (85, "piece 2"), (3, "piece 0"), (101, trailer)):
        put(good[:pos] + bytes([good[pos] ^ 0x10]) + good[pos + 1 :])
        if piece is None:  # a byte of piece 1, which holds no element either region needs
            head, odd = load()
            assert torch.equal(head, flat[:5]) and torch.equal(odd, flat[21:24:2])
        else:
            with pytest.raises(CorruptCheckpointError, match=rf"flat/c/0: .*{piece}"):
                load()
    put(good)
    head, odd = load()
    assert torch.equal(head, flat[:5]) and torch.equal(odd, flat[21:24:2])


@pytest.mark.parametrize("run_bytes", [8, 1 << 20], ids=["runs-into-place", "through-scratch"])
def test_a_partial_read_checks_and_reads_only_the_pieces_it_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_bytes: int
) -> None:
    """Local reads (:func:`_partial_read_case`); ``ckptd verify`` checks every piece's recorded value
    against the bytes."""
    from ckptd.client import chunkio, fastread
    from ckptd.writer import checksum

    monkeypatch.setattr(checksum, "PIECE_BYTES", 40)
    monkeypatch.setattr(fastread, "_RUN", run_bytes)
    root = str(tmp_path / "ckpt")
    path = Path(root, "step_1", "flat", "c", "0")
    _partial_read_case(root, None, path.read_bytes, path.write_bytes)

    async def progress() -> ByteProgress:  # what a load's progress counts: the bytes of the pieces it read
        async with open_root(root, None, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1))
            reader.add_gather("flat", torch.zeros(5), Strided(0, (5,), (1,)))
            reader.add_gather("flat", torch.zeros(2), Strided(21, (2,), (2,)))
            await reader.run()
            return reader.progress

    counted = asyncio.run(progress())
    assert counted.done == counted.total == 40 + 20  # pieces 0 and 2 of chunk 0

    rec = next(r for r in read_commit(root, 1).arrays if r.name == "flat")
    shard, chunk = rec.shards[0], rec.shards[0].chunks[0]
    assert len(chunk.pieces) == 3 * 4 and chunk.crc32c == checksum.crc32c(ARRAYS["flat"][0][:25].numpy().tobytes())
    values = [checksum.piece_value(chunk.pieces, i) for i in range(3)]
    wrong = msgspec.structs.replace(chunk, pieces=checksum.pack_pieces([values[0], values[1] ^ 1, values[2]]))
    tampered = msgspec.structs.replace(rec, shards=[msgspec.structs.replace(shard, chunks=[wrong, *shard.chunks[1:]])])

    async def verify(record: fmt.ArrayRecord) -> int:
        async with open_root(root, None, create=False) as ckpt:
            return await verify_array(ckpt.store, fmt.step_dir(1), record)

    assert asyncio.run(verify(rec)) == 400
    with pytest.raises(CorruptCheckpointError, match=r"flat: chunk \[0\]: the manifest's crc32c of piece 1"):
        asyncio.run(verify(tampered))

    # piece checksums of another count (another piece size): the chunk is read and checked whole
    path = Path(root, "step_1", "flat", "c", "0")
    good = path.read_bytes()
    path.write_bytes(good[:50] + bytes([good[50] ^ 0x10]) + good[51:])
    head = torch.zeros(5)
    region, dst = Strided(0, (5,), (1,)), head.view(torch.int32).numpy()
    for pieces, check in ((chunk.pieces[:8], "stored bytes have crc32c"), (chunk.pieces, None)):
        record = msgspec.structs.replace(chunk, pieces=pieces)
        job = Job("step_1/flat/c/0", record, None, item=4, gather=[(region, dst)], scattered=[(region, dst)])
        job.pieces = chunkio.needed_pieces(job)  # as the reader plans it
        assert job.pieces == (None if check else [0])
        if check is None:
            chunkio.read_local(str(path), job)  # piece 1 holds no element of the region: not read
            assert torch.equal(head, ARRAYS["flat"][0][:5])
        else:
            with pytest.raises(CorruptCheckpointError, match=check):
                chunkio.read_local(str(path), job)


@pytest.mark.s3
def test_s3_partial_reads_get_only_the_pieces_they_need(
    s3_options: dict[str, object], s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranged GETs (:func:`_partial_read_case`): chunk 0 of ``flat`` is fetched as pieces 0 and 2 with its
    trailer, never piece 1."""
    from ckptd.writer import checksum
    from ckptd.writer.backends.s3 import S3Backend

    monkeypatch.setattr(checksum, "PIECE_BYTES", 40)
    url = f"s3://{BUCKET}/fastread-pieces"
    client, key = s3.client(), url.split("/", 3)[3] + "/step_1/flat/c/0"
    fetched: list[tuple[int, int]] = []
    read_into = S3Backend.read_into

    async def recording(self: S3Backend, path: str, start: int, bufs: Sequence[memoryview]) -> tuple[int, int | None]:
        if path.endswith("flat/c/0"):
            fetched.append((start, start + sum(b.nbytes for b in bufs)))
        return await read_into(self, path, start, bufs)

    monkeypatch.setattr(S3Backend, "read_into", recording)
    _partial_read_case(url, s3_options, lambda: client.get_object(Bucket=BUCKET, Key=key)["Body"].read(),
                       lambda body: client.put_object(Bucket=BUCKET, Key=key, Body=body))
    assert fetched and set(fetched) == {(0, 7), (7, 14), (14, 21), (21, 28), (28, 35), (35, 40), (80, 87),
                                        (87, 94), (94, 101), (101, 104)}


def test_a_failed_read_stops_the_others_and_nothing_lands_after_the_error(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local reads: two threads drain one list of chunks; the first failure stops both, and the load raises
    only once neither is still writing into the destinations."""
    from ckptd.client import fastread

    landed: list[str] = []

    def slow(path: str, job: Job) -> None:
        if job.path.endswith("w/c/0/0"):  # fails while the other thread reads the next chunk
            time.sleep(0.01)
            raise CorruptCheckpointError(f"{job.path}: injected")
        time.sleep(0.5)  # long after the failure, even with this process's threads slow to run on a loaded runner
        read_local(path, job)
        landed.append(job.path)

    monkeypatch.setattr(fastread, "read_local", slow)

    async def go() -> list[str]:
        async with open_root(root, None, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1), concurrency=2)
            reader.add("w", torch.zeros(7, 5), (0, 0))  # 4 whole chunks, read first; the first fails
            reader.add("flat", torch.zeros(100), (0,))  # 4 chunks more
            with pytest.raises(CorruptCheckpointError, match="injected"):
                await reader.run()
            return list(landed)

    at_error = asyncio.run(go())
    time.sleep(0.2)
    assert landed == at_error  # nothing landed after the load failed
    assert landed in ([], ["step_1/w/c/1/0"])  # only the chunk the other thread had begun; nothing after it


def test_a_whole_array_of_one_chunk_is_one_direct_read_and_checked(tmp_path: Path) -> None:
    """A plain tensor saved whole (one chunk) is planned as one direct read into the destination, without the
    per-chunk geometry of the general paths: bit-exact, and a damaged chunk still fails the load."""
    arrays = {"m": (torch.randn(3, 4, generator=G), 3), "v16": (torch.randn(6, generator=G).to(torch.bfloat16), 6)}
    path = str(tmp_path / "ckpt")
    _write(path, arrays=arrays)
    out = {k: torch.zeros_like(t) for k, (t, _) in arrays.items()}

    async def planned() -> list[Job]:
        async with open_root(path, None, create=False) as ckpt:
            reader = ChunkReader(ckpt, await ckpt.read_commit(1))
            for k, dst in out.items():
                reader.add(k, dst, (0,) * dst.dim())
            assert not reader.gathers and not reader.slow and not reader.staged
            jobs = list(reader.jobs)
            await reader.run()
            return jobs

    jobs = asyncio.run(planned())
    assert sorted(j.path for j in jobs) == ["step_1/m/c/0/0", "step_1/v16/c/0"]
    assert all(j.direct is not None and j.direct.nbytes == j.chunk.nbytes for j in jobs)
    for k, (t, _) in arrays.items():
        assert torch.equal(out[k].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
    chunk = os.path.join(path, "step_1", "v16", "c", "0")
    data = bytearray(Path(chunk).read_bytes())
    data[3] ^= 0x01
    Path(chunk).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="v16"):
        load(path, 1, {k: torch.zeros_like(t) for k, (t, _) in arrays.items()})
