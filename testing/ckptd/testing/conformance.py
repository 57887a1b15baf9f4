"""One conformance suite for every storage backend (as zarr-python runs one store suite over every store).

Subclass :class:`BackendConformance` in a test module, name the subclass ``Test...``, set
:attr:`~BackendConformance.expected` and provide three fixtures:

* ``backend_url`` — a fresh, empty root for one test (a temporary directory, a unique S3 prefix);
* ``backend_options`` — the storage options to open it with;
* ``missing_url`` — a root that cannot exist (a missing directory, a missing bucket).

Every test opens the backend through :func:`ckptd.writer.backends.open_backend`, as the daemon and the
readers do, and checks behaviour the commit protocol relies on: object round trips, listing,
create-once semantics, durability calls, typed errors, chunk writes read back through zarr, and the
commit sequence driven by the declared capabilities.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar

import numpy as np
import pytest

from ckptd.writer.arrays import (
    ChunkSink,
    array_metadata,
    checksum,
    open_array,
    read_region,
    verify_array,
    write_metadata,
)
from ckptd.writer.backends import Backend, Capabilities, open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import (
    CkptdError,
    CorruptCheckpointError,
    StepCommittedError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)
from ckptd.writer.format import (
    FORMAT_VERSION,
    ArrayRecord,
    ChunkRecord,
    ChunkSeparator,
    PartManifest,
    ShardRecord,
    chunk_key,
    commit_marker,
    step_dir,
)
from ckptd.writer.root import CheckpointRoot


class BackendConformance:
    """The tests every :class:`~ckptd.writer.backends.Backend` must pass (not collected by itself)."""

    #: the capabilities the backend under test must declare
    expected: ClassVar[Capabilities]
    #: whether the backend offers the raw local-file path (``local_root``)
    expects_local_root: ClassVar[bool] = False

    @pytest.fixture
    async def backend(self, backend_url: str, backend_options: Mapping[str, Any]) -> AsyncIterator[Backend]:
        opened = await open_backend(backend_url, backend_options)
        try:
            yield opened
        finally:
            await opened.close()

    # --- what the backend says about itself ---------------------------------------------------------
    async def test_capabilities_are_declared(self, backend: Backend) -> None:
        assert backend.capabilities == self.expected
        assert (backend.local_root is not None) == self.expects_local_root
        assert backend.store is not None

    async def test_close_is_idempotent(self, backend_url: str, backend_options: Mapping[str, Any]) -> None:
        opened = await open_backend(backend_url, backend_options)
        await opened.close()
        await opened.close()

    # --- objects ------------------------------------------------------------------------------------
    async def test_put_get_exists(self, backend: Backend) -> None:
        assert await backend.get("a/missing") is None
        assert not await backend.exists("a/missing")
        await backend.put("a/obj", b"one")
        assert await backend.get("a/obj") == b"one"
        assert await backend.exists("a/obj")
        await backend.put("a/obj", b"two")  # plain puts overwrite
        assert await backend.get("a/obj") == b"two"
        body = bytearray(np.arange(1 << 16, dtype=np.uint8).tobytes())
        await backend.put_body("a/body", body)
        assert await backend.get("a/body") == bytes(body)

    async def test_read_into(self, backend: Backend) -> None:
        data = np.arange(1000, dtype=np.uint8).tobytes()
        await backend.put("r/obj", data)
        head, tail = bytearray(7), bytearray(5)  # a range split over two destinations
        got, size = await backend.read_into("r/obj", 990, [memoryview(head), memoryview(tail)])
        assert (got, bytes(head + tail)[:got]) == (10, data[990:]) and size in (None, 1000)  # the object ends first
        got, size = await backend.read_into("r/obj", 3, [memoryview(head)])
        assert (got, bytes(head)) == (7, data[3:10]) and size in (None, 1000)
        with pytest.raises(StorageNotFoundError):
            await backend.read_into("r/missing", 0, [memoryview(head)])

    async def test_list_dir(self, backend: Backend) -> None:
        for key in ("d/x", "d/y", "d/sub/z", "e"):
            await backend.put(key, key.encode())
        assert {"d", "e"} <= set(await backend.list_dir(""))
        assert sorted(await backend.list_dir("d")) == ["sub", "x", "y"]
        assert await backend.list_dir("d/sub") == ["z"]
        assert await backend.list_dir("nothing/here") == []

    async def test_delete_and_delete_prefix(self, backend: Backend) -> None:
        for key in ("s/1", "s/2/a", "t"):
            await backend.put(key, b"x")
        await backend.delete("t")
        assert await backend.get("t") is None
        await backend.delete("t")  # a missing object is not an error
        await backend.delete_prefix("s")
        assert await backend.get("s/1") is None and await backend.get("s/2/a") is None
        assert "s" not in await backend.list_dir("")

    # --- create-once ----------------------------------------------------------------------------------
    async def test_create_once(self, backend: Backend) -> None:
        assert await backend.create("m/COMMITTED", b"one") is True
        assert await backend.create("m/COMMITTED", b"two") is False
        assert await backend.get("m/COMMITTED") == b"one"
        assert await backend.create("m/COMMITTED", b"one") is True  # identical bytes: a retried write of ours

    async def test_racing_creates_have_one_winner(self, backend: Backend) -> None:
        if not backend.capabilities.atomic_create:
            pytest.skip("the backend declares no atomic create")
        results = await asyncio.gather(*(backend.create("race/M", f"writer{i}".encode()) for i in range(4)))
        assert sum(results) == 1, results
        winner = results.index(True)
        assert await backend.get("race/M") == f"writer{winner}".encode()

    # --- durability and cleanup -----------------------------------------------------------------------
    async def test_sync(self, backend: Backend) -> None:
        await backend.put("f/a", b"a")
        await backend.sync(["f/a"])
        await backend.sync(["f/a"], files=False)
        await backend.sync_all()
        if backend.capabilities.needs_fsync:
            with pytest.raises(StorageNotFoundError):  # nothing to make durable: the write never happened
                await backend.sync(["f/never-written"])
        else:
            await backend.sync(["f/never-written"])  # durable on put: nothing to do

    async def test_abort_uploads(self, backend: Backend) -> None:
        assert await backend.abort_uploads("step_1") == 0

    # --- errors ---------------------------------------------------------------------------------------
    async def test_error_classification(self, backend: Backend) -> None:
        assert isinstance(backend.error(FileNotFoundError("gone")), StorageNotFoundError)
        assert isinstance(backend.error(PermissionError("denied")), StoragePermissionError)
        generic = backend.error(RuntimeError("boom"))
        assert type(generic) is StorageError and "boom" in str(generic)
        typed = StepCommittedError("already")
        assert backend.error(typed) is typed
        assert isinstance(backend.error(OSError("x")), CkptdError)

    async def test_missing_root_is_not_found(self, missing_url: str, backend_options: Mapping[str, Any]) -> None:
        with pytest.raises(StorageNotFoundError):
            backend = await open_backend(missing_url, backend_options, create=False)
            await backend.close()

    # --- arrays and the commit sequence ---------------------------------------------------------------
    @pytest.mark.parametrize("separator", ["/", "."])  # as formats 1-3 wrote chunk keys, and as format 4 does
    async def test_chunks_through_arrays(self, backend: Backend, separator: ChunkSeparator) -> None:
        data = np.arange(48, dtype=np.float32).reshape(6, 8)
        chunks = (3, 8)
        meta = await array_metadata("float32", data.shape, chunks, separator=separator)
        sink = ChunkSink(backend)
        records = []
        for row in range(2):
            block = data[row * 3 : (row + 1) * 3]
            crc, pieces = await sink.put(f"step_1/w/{chunk_key((row, 0), separator)}", block)
            assert crc == await checksum(block)
            records.append(ChunkRecord([row, 0], block.nbytes, crc, pieces))
        if backend.capabilities.needs_fsync:
            await backend.sync([f"step_1/w/{chunk_key((r, 0), separator)}" for r in range(2)], files=False)
        await write_metadata(backend.store, "step_1/w", meta)
        arr = await open_array(backend.store, "step_1/w")
        assert np.array_equal(await read_region(arr, (2, 0), (3, 8)), data[2:5])
        shard = ShardRecord(0, [0, 0], [6, 8], records)
        rec = ArrayRecord("w", "float32", list(data.shape), list(chunks), [shard], separator=separator)
        assert await verify_array(backend.store, step_dir(1), rec) == data.nbytes
        other = ArrayRecord("w", "float32", list(data.shape), list(chunks), [shard],
                            separator="." if separator == "/" else "/")
        # the record's chunk keys are another separator than the array document's: caught as a mismatch
        with pytest.raises(CorruptCheckpointError, match=r"separator '.'; the commit manifest records .*'.'"):
            await verify_array(backend.store, step_dir(1), other)

    async def test_commit_sequence(self, backend: Backend) -> None:
        writer = CheckpointWriter(backend)
        part = PartManifest(format=FORMAT_VERSION, step=3, node=0, num_nodes=1, world_size=1, ranks=[0],
                            arrays=[], objects={}, nbytes=0, written_at=0.0)
        await writer.write_part(part)
        commit = await writer.commit(3, 1, timeout=10)
        assert commit.step == 3
        assert await backend.exists(commit_marker(3))
        root = CheckpointRoot(backend)
        assert await root.committed_steps() == [3]
        assert await root.latest_hint() == 3
        assert (await root.read_commit(3)).step == 3
        with pytest.raises(StepCommittedError):
            await writer.write_marker(3, b"{}")  # a second coordinator loses, whatever it writes
        with pytest.raises(StepCommittedError):
            await writer.commit(3, 1, timeout=10)
