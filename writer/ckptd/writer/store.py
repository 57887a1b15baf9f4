"""Open a checkpoint root (local path, ``file://`` or ``s3://``) as an async zarr store over fsspec.

Stores must be created inside the running event loop: fsspec async instances bind to the loop that
made them (hence ``skip_instance_cache=True`` for S3). Everything above this module sees only the zarr
``Store`` interface, so nothing assumes a local filesystem; the one local-only extra is :func:`fsync`,
which makes written files durable before a node part manifest claims them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlparse

import fsspec
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from zarr.abc.store import Store
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.storage import FsspecStore

from ckptd.writer.errors import StorageError, StorageNotFoundError


def normalize_root(root: str) -> str:
    """``/a/b``, ``file:///a/b`` and ``./a`` become absolute local paths; URLs keep their scheme."""
    scheme = urlparse(root).scheme
    if scheme in ("", "file"):
        path = root.removeprefix("file://") if scheme == "file" else root
        return os.path.abspath(os.path.expanduser(path))
    return root.rstrip("/")


def is_local(root: str) -> bool:
    return urlparse(normalize_root(root)).scheme == ""


async def open_store(root: str, options: Mapping[str, Any] | None = None, *, create: bool = True) -> Store:
    """The zarr store for ``root``. ``options`` are fsspec storage options (S3: see ``ckptd.writer.s3``)."""
    root = normalize_root(root)
    scheme = urlparse(root).scheme
    if scheme == "":
        if create:
            os.makedirs(root, exist_ok=True)
        elif not os.path.isdir(root):
            raise StorageNotFoundError(f"checkpoint root {root} does not exist")
        fs = AsyncFileSystemWrapper(fsspec.filesystem("file", auto_mkdir=True))
        return FsspecStore(fs, path=root, read_only=False)
    if scheme == "s3":
        from ckptd.writer.s3 import open_s3_store

        return await open_s3_store(root, dict(options or {}))
    raise StorageError(f"unsupported checkpoint root {root!r}: use a local path, file:// or s3://")


def store_root(store: Store) -> str:
    return str(getattr(store, "path", ""))


def buffer(data: bytes) -> Buffer:
    return default_buffer_prototype().buffer.from_bytes(data)


async def get_bytes(store: Store, key: str) -> bytes | None:
    buf = await store.get(key, prototype=default_buffer_prototype())
    return None if buf is None else buf.to_bytes()


async def put_bytes(store: Store, key: str, data: bytes) -> None:
    await store.set(key, buffer(data))


async def list_dir(store: Store, prefix: str) -> list[str]:
    """Immediate children names under ``prefix`` (no trailing slash)."""
    return [name.rstrip("/") async for name in store.list_dir(prefix)]


async def fsync(store: Store, keys: Iterable[str]) -> None:
    """Flush written objects to stable storage. Object stores are durable on PUT; local files need fsync."""
    root = store_root(store)
    if urlparse(root).scheme or not isinstance(store, FsspecStore) or not root.startswith("/"):
        return
    paths = [os.path.join(root, k) for k in keys]

    def _sync() -> None:
        dirs = set()
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(os.path.dirname(p))
        for d in dirs:
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    await asyncio.to_thread(_sync)
