"""Open a checkpoint root (local path, ``file://`` or ``s3://``) as an async zarr store over fsspec.

Stores must be created inside the running event loop: fsspec async instances bind to the loop that
made them (hence ``skip_instance_cache=True`` for S3). Everything above this module sees only the zarr
``Store`` interface plus the few storage-specific operations here, so nothing assumes a local filesystem:
:func:`fsync` (local files need it before a node part manifest claims them; object PUTs are durable),
:func:`put_if_absent` (the commit marker's create-once write), :func:`abort_uploads` (multipart uploads
left by a crashed writer), :func:`storage_error` (typed errors) and :func:`close_store`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import uuid
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlparse

import fsspec
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from zarr.abc.store import Store
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.storage import FsspecStore

from ckptd.writer.errors import (
    CkptdError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
)


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
        from ckptd.writer.s3 import check_bucket, open_s3_store

        store = await open_s3_store(root, dict(options or {}))
        try:  # a missing bucket or denied access fails here, loudly, not on the first write
            await check_bucket(store.fs, root)
        except BaseException:
            await close_store(store)
            raise
        return store
    raise StorageError(f"unsupported checkpoint root {root!r}: use a local path, file:// or s3://")


def store_root(store: Store) -> str:
    return str(getattr(store, "path", ""))


def _s3fs(store: Store) -> Any:
    """The S3 filesystem under ``store``, or ``None`` for any other storage."""
    if not isinstance(store, FsspecStore) or local_path(store) is not None:
        return None  # without importing the S3 stack (botocore costs ~0.3 s, once, on a save path)
    from ckptd.writer.s3 import s3_options

    return store.fs if s3_options(store.fs) is not None else None


async def close_store(store: Store) -> None:
    """Release the store's network clients (the S3 HTTP session); a no-op for local storage."""
    fs = _s3fs(store)
    if fs is not None:
        from ckptd.writer.s3 import close_s3_filesystem

        await close_s3_filesystem(fs)


def storage_error(exc: BaseException, url: str) -> CkptdError:
    """The typed ckptd error for a failure of ``url``'s storage (``raise storage_error(e, url) from e``).

    S3 errors are classified by their S3 code (missing bucket, denied, transient fault that outlived its
    retries); local ones by their ``OSError`` type. Errors that are already typed pass through.
    """
    if isinstance(exc, CkptdError):
        return exc
    if urlparse(url).scheme == "s3":
        from ckptd.writer.s3 import classify_error

        return classify_error(exc, url)
    if isinstance(exc, FileNotFoundError):
        return StorageNotFoundError(f"{url}: {exc}")
    if isinstance(exc, PermissionError):
        return StoragePermissionError(f"{url}: {exc}")
    return StorageError(f"{url}: {type(exc).__name__}: {exc}")


def retry_metrics(store: Store) -> Any:
    """The store's :class:`~ckptd.writer.s3.S3Metrics` (retries and faults so far), ``None`` if not S3."""
    fs = _s3fs(store)
    if fs is None:
        return None
    from ckptd.writer.s3 import s3_metrics

    return s3_metrics(fs)


async def put_if_absent(store: Store, key: str, data: bytes) -> bool:
    """Create ``key`` holding ``data`` unless it exists. ``True`` if it now holds ``data`` because of us.

    S3: a conditional PUT (``If-None-Match: *``), atomic where the endpoint honours it (see
    :func:`ckptd.writer.s3.put_if_absent`). Local: written to a temporary name, made durable, then
    hard-linked into place, which fails if the name exists — atomic, and readers never see a partial
    file. Other stores: check, then write (not atomic).
    """
    fs = _s3fs(store)
    if fs is not None:
        from ckptd.writer.s3 import put_if_absent as s3_put_if_absent
        from ckptd.writer.s3 import s3_options

        opts = s3_options(fs)
        conditional = opts.conditional_put if opts is not None else True
        return bool(await s3_put_if_absent(fs, f"{store_root(store)}/{key}", data, conditional=conditional))
    root = local_path(store)
    if root is not None:
        return await asyncio.to_thread(_link_into_place, os.path.join(root, key), data)
    if await store.exists(key):
        return await get_bytes(store, key) == data
    await put_bytes(store, key, data)
    return True


def _link_into_place(path: str, data: bytes) -> bool:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            with open(path, "rb") as fh:
                return fh.read() == data
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_path(os.path.dirname(path))
    return True


def _fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def abort_uploads(store: Store, prefix: str) -> int:
    """Abort unfinished multipart uploads under ``prefix`` (S3 only); returns how many."""
    fs = _s3fs(store)
    if fs is None:
        return 0
    from ckptd.writer.s3 import abort_incomplete_uploads

    bucket, _, base = store_root(store).partition("/")
    key_prefix = f"{base}/{prefix}".strip("/") + "/"
    return int(await abort_incomplete_uploads(fs, bucket, key_prefix))


def buffer(data: bytes) -> Buffer:
    return default_buffer_prototype().buffer.from_bytes(data)


async def get_bytes(store: Store, key: str) -> bytes | None:
    buf = await store.get(key, prototype=default_buffer_prototype())
    return None if buf is None else buf.to_bytes()


async def put_bytes(store: Store, key: str, data: bytes) -> None:
    await store.set(key, buffer(data))


async def put_body(store: Store, key: str, body: bytearray) -> None:
    """Write a large object without the copies of zarr's ``Buffer`` round trip (``store.set`` converts
    the buffer to ``bytes`` once more): async fsspec filesystems take the bytearray as the request body."""
    if isinstance(store, FsspecStore) and getattr(store.fs, "async_impl", False) and local_path(store) is None:
        await store.fs._pipe_file(f"{store_root(store)}/{key}", body)
    else:
        await store.set(key, buffer(bytes(body)))


async def list_dir(store: Store, prefix: str) -> list[str]:
    """Immediate children names under ``prefix`` (no trailing slash)."""
    return [name.rstrip("/") async for name in store.list_dir(prefix)]


def local_path(store: Store) -> str | None:
    """The directory of a store on the local filesystem, or None for object stores."""
    root = store_root(store)
    if not isinstance(store, FsspecStore) or urlparse(root).scheme or not root.startswith("/"):
        return None
    protocol = getattr(store.fs, "protocol", "")
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return root if "file" in protocols or "local" in protocols else None


async def sync_all(store: Store) -> None:
    """Make everything written under a local root durable with one ``syncfs`` of its filesystem (object
    stores are durable on PUT). For jobs that write many small files, where one fsync each is slow."""
    root = local_path(store)
    if root is None:
        return

    def _syncfs() -> None:
        fd = os.open(root, os.O_RDONLY)
        try:
            if _LIBC.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), root)
        finally:
            os.close(fd)

    await asyncio.to_thread(_syncfs)


_LIBC = ctypes.CDLL(None, use_errno=True)


async def fsync(store: Store, keys: Iterable[str], *, files: bool = True) -> None:
    """Flush written objects to stable storage. Object stores are durable on PUT; local files need fsync
    (of the files unless they were synced when written, and of their directories)."""
    root = local_path(store)
    if root is None:
        return
    paths = [os.path.join(root, k) for k in keys]

    def _sync() -> None:
        dirs = set()
        for p in paths:
            dirs.add(os.path.dirname(p))
            if files:
                _fsync_path(p)
        for d in dirs:
            _fsync_path(d)

    await asyncio.to_thread(_sync)
