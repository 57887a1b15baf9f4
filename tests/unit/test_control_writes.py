"""The control objects a commit rewrites (a node's part manifest, the ``latest`` hint) are replaced whole:
a reader sees the old bytes or the new. What is left by an earlier release that wrote them in place is
reported by name (a torn part) or ignored (a torn ``latest``: only a hint); a write aside is never taken
for a part; and a ``latest`` that cannot be moved does not turn a committed step into a failed one."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from ckptd.testing.fixtures import BUCKET
from ckptd.writer import format as fmt
from ckptd.writer.backends import Backend, open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import CorruptCheckpointError, StorageFullError


def _part(step: int, pad: int = 16) -> fmt.PartManifest:
    return fmt.PartManifest(fmt.FORMAT_VERSION, step, 0, 1, 1, [0], [], {"0": {"pad": "x" * pad}}, 0, time.time())


def _run(url: str, options: dict[str, object] | None, body: object) -> None:
    async def go() -> None:
        async with await open_backend(url, options, create=True) as backend:
            await body(backend, CheckpointWriter(backend))  # type: ignore[operator]

    asyncio.run(go())


async def _rewrites(backend: Backend, w: CheckpointWriter) -> None:
    first, second = _part(1), _part(1, pad=5000)
    await w.write_part(first)
    await w.write_part(second)  # a second attempt of the step: replaced, not appended to or mixed
    assert await w.read_parts(1) == {0: second}
    await w.write_part(first)
    assert await w.read_parts(1) == {0: first}
    await w.commit(1, 1, timeout=5)
    assert await w.latest_hint() == 1


def test_parts_and_latest_are_replaced_whole(tmp_path: Path) -> None:
    _run(str(tmp_path / "root"), None, _rewrites)
    assert sorted(p.name for p in (tmp_path / "root").rglob("*.tmp")) == []


@pytest.mark.s3
def test_parts_and_latest_are_replaced_whole_on_s3(s3_options: dict[str, object]) -> None:
    _run(f"s3://{BUCKET}/control-writes", s3_options, _rewrites)


def test_a_torn_part_is_named_and_a_write_aside_is_not_a_part(tmp_path: Path) -> None:
    async def body(backend: Backend, w: CheckpointWriter) -> None:
        whole = fmt.encode_json(_part(3))
        folder = fmt.parts_dir(3)
        # a part being written aside (or left by a kill before its rename) is not read as a part
        await backend.put(f"{folder}/node-0.json.0123abcd.tmp", whole[:7])
        assert await w.read_parts(3) == {}
        await backend.put(fmt.part_key(3, 0), whole)
        assert (await w.read_parts(3))[0] == fmt.decode_part(whole)
        # torn in place (an earlier release wrote parts in place): a typed error naming it, not a decode error
        await backend.put(fmt.part_key(3, 0), whole[: len(whole) // 2])
        with pytest.raises(CorruptCheckpointError, match=r"node-0\.json.*damaged"):
            await w.read_parts(3)

    _run(str(tmp_path / "root"), None, body)


def test_latest_that_cannot_be_moved_leaves_the_step_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(backend: Backend, w: CheckpointWriter) -> None:
        await w.write_part(_part(1))
        await w.commit(1, 1, timeout=5)
        await w.write_part(_part(2))

        async def full(key: str, data: bytes) -> None:
            raise StorageFullError(f"{key}: no space left (injected)")

        backend.replace = full  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="ckptd.writer.commit"):
            manifest = await w.commit(2, 1, timeout=5)
        assert manifest.step == 2 and await w.is_committed(2)
        assert await w.latest() == 2  # the markers say so; the hint lags
        assert await w.latest_hint() == 1
        assert "step 2 is committed" in caplog.text and "latest" in caplog.text

    _run(str(tmp_path / "root"), None, body)


async def _leftovers(backend: Backend, w: CheckpointWriter) -> None:
    """A step's first save probes storage once for what an earlier attempt left (one thread hop on local
    disk, the keys at once on S3): each of the marker, the part and the failure note is seen, alone."""
    assert await w.leftovers(3, 0) == (False, False, False)
    await w.write_part(_part(3))
    assert await w.leftovers(3, 0) == (False, True, False)
    assert await w.leftovers(3, 1) == (False, False, False)  # another node's part is not this node's
    await w.commit(3, 1, timeout=5)
    assert (await w.leftovers(3, 0)).committed
    await backend.put(fmt.failed_marker(4), b"{}")
    assert await w.leftovers(4, 0) == (False, False, True)
    keys = [fmt.commit_marker(3, fmt.CONTROL_LAYOUTS[-1]), fmt.failed_marker(4), fmt.failed_marker(5)]
    assert await backend.exists_all(keys) == [await backend.exists(k) for k in keys] == [True, True, False]


def test_leftovers_are_probed_at_once(tmp_path: Path) -> None:
    _run(str(tmp_path / "root"), None, _leftovers)


@pytest.mark.s3
def test_leftovers_are_probed_at_once_on_s3(s3_options: dict[str, object]) -> None:
    _run(f"s3://{BUCKET}/leftovers", s3_options, _leftovers)


def test_the_roots_shared_documents_are_written_whole_and_only_when_they_differ(tmp_path: Path) -> None:
    """Every commit declares the root a zarr group and its control folder an empty array. Rewritten in place,
    a commit cut short (or a reader meanwhile) found the root's group document empty, and zarr could open no
    step; now they are left alone when they hold the same bytes, and replaced whole when they do not (a torn
    document left by an earlier release is repaired by the next commit)."""
    import zarr

    root = tmp_path / "root"
    docs = [root / "zarr.json", root / fmt.control_dir("") / "zarr.json"]

    async def body(backend: Backend, w: CheckpointWriter) -> None:
        await w.write_part(_part(1))
        await w.commit(1, 1, timeout=5)
        first = [(d.stat().st_ino, d.stat().st_mtime_ns, d.read_bytes()) for d in docs]
        time.sleep(0.02)
        await w.write_part(_part(2))
        await w.commit(2, 1, timeout=5)
        assert [(d.stat().st_ino, d.stat().st_mtime_ns, d.read_bytes()) for d in docs] == first  # not written
        docs[0].write_bytes(b"")  # torn by an older release's in-place write
        await w.write_part(_part(3))
        await w.commit(3, 1, timeout=5)
        assert docs[0].read_bytes() == first[0][2] and docs[0].stat().st_ino != first[0][0]  # replaced whole

    _run(str(root), None, body)
    assert zarr.open_group(str(root), mode="r").attrs["ckptd"] == {"format": fmt.FORMAT_VERSION}
