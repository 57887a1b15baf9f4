"""A layout sidecar is stored once per root and named by every later step, so it is created whole or not at
all; one found damaged (torn by a kill mid-write of an earlier release, which wrote it in place) is written
again, and every step that names it reads it back checked against its hash. Local disk and S3 (moto)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ckptd.testing.fixtures import BUCKET
from ckptd.writer import format as fmt
from ckptd.writer.backends import open_backend
from ckptd.writer.commit import CheckpointWriter
from ckptd.writer.errors import CorruptCheckpointError
from ckptd.writer.root import open_root

TEXT = '{"layout": [' + ", ".join(str(i) for i in range(2000)) + "]}"
NAME = fmt.sidecar_name(TEXT)


def _write(url: str, options: dict[str, object] | None) -> bool:
    async def go() -> bool:
        async with await open_backend(url, options, create=True) as backend:
            return await CheckpointWriter(backend).write_sidecar(NAME, TEXT)

    return asyncio.run(go())


def _read(url: str, options: dict[str, object] | None) -> str:
    async def go() -> str:
        async with open_root(url, options) as ckpt:
            return await ckpt.read_sidecar(NAME)

    return asyncio.run(go())


def _damage(url: str, options: dict[str, object] | None) -> None:
    async def go() -> None:
        async with await open_backend(url, options, create=True) as backend:
            key = fmt.sidecar_key(NAME)
            data = await backend.get(key)
            assert data is not None
            await backend.put(key, data[: len(data) // 2])

    asyncio.run(go())


def _check(url: str, options: dict[str, object] | None = None) -> None:
    assert _write(url, options) is True
    assert _write(url, options) is False  # already there, whole
    _damage(url, options)
    with pytest.raises(CorruptCheckpointError, match="does not match its hash"):
        _read(url, options)
    assert _write(url, options) is True  # found torn: written again
    assert _read(url, options) == TEXT


def test_a_torn_sidecar_is_written_again(tmp_path: Path) -> None:
    _check(str(tmp_path / "root"))
    # nothing left beside it (the whole document was written aside, then linked into place)
    folder = tmp_path / "root" / Path(fmt.sidecar_key(NAME)).parent
    assert [p.name for p in folder.iterdir()] == [Path(fmt.sidecar_key(NAME)).name]


@pytest.mark.s3
def test_a_torn_sidecar_is_written_again_on_s3(s3_options: dict[str, object]) -> None:
    _check(f"s3://{BUCKET}/sidecar-write", s3_options)
