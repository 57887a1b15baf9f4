"""A checkpoint root in a local (or network-mounted POSIX) directory.

Files are durable only after ``fsync`` (of the file and of its directory), or after one ``syncfs`` of the
filesystem (:meth:`LocalBackend.sync_all`: many small files at once); the create-once write goes
to a temporary name, is made durable, then hard-linked into place, which fails if the name exists —
atomic, and readers never see a partial file.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import os
import stat
import uuid
from collections.abc import Iterable, Iterator, Sequence

import fsspec
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from zarr.storage import FsspecStore

from ckptd.writer.backends import Backend, Capabilities
from ckptd.writer.errors import (
    NO_SPACE_ERRNOS,
    CkptdError,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
)

CAPABILITIES = Capabilities(atomic_create=True, needs_fsync=True, multipart_cleanup=False)
_LIBC = ctypes.CDLL(None, use_errno=True)


@functools.cache
def _async_local_fs(pid: int) -> AsyncFileSystemWrapper:
    """fsspec's local filesystem as zarr's async store wants it, made once per process (``pid``: a forked
    child makes its own). The wrapper holds no loop or connection (each call is a thread hop), but it builds
    its methods by introspection: 1.3-1.8 ms of every open of a root on the 2-core dev VM (7 ms under
    cProfile), which every load and every ``ckptd`` command paid."""
    return AsyncFileSystemWrapper(fsspec.filesystem("file", auto_mkdir=True), asynchronous=True)


class LocalBackend(Backend):
    """A directory on a POSIX filesystem, seen through fsspec's local filesystem."""

    def __init__(self, path: str) -> None:
        fs = _async_local_fs(os.getpid())
        super().__init__(path, FsspecStore(fs, path=path, read_only=False), CAPABILITIES)
        self._path = path

    @classmethod
    def open(cls, path: str, *, create: bool = True) -> LocalBackend:
        """The backend at absolute ``path``; with ``create`` the directory is made if missing. A root that
        cannot be made or reached (a parent without search permission) is a typed :class:`StorageError`."""
        try:
            if create:
                os.makedirs(path, exist_ok=True)
            st = os.stat(path)  # not os.path.isdir: it takes a parent we may not search (EACCES) for "missing"
        except FileNotFoundError as exc:
            raise StorageNotFoundError(f"checkpoint root {path} does not exist") from exc
        except OSError as exc:
            what = "create" if create else "open"
            raise _typed_error(f"cannot {what} checkpoint root {path}", exc) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise StorageNotFoundError(f"checkpoint root {path} is not a directory")
        return cls(path)

    @property
    def local_root(self) -> str:
        return self._path

    async def create(self, key: str, data: bytes) -> bool:
        try:
            return await asyncio.to_thread(_link_into_place, os.path.join(self._path, key), data)
        except OSError as exc:
            raise self.error(exc) from exc

    async def exists(self, key: str) -> bool:
        """Whether ``key`` is there (:func:`_exists`: a failure to look is a typed error, never "absent")."""
        return (await self.exists_all([key]))[0]

    async def exists_all(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`exists` of each key, in one thread hop: a step's first save probes four keys, and four hops
        cost ~1 ms on the 2-core VM while the rank waits for the answer."""
        paths = [os.path.join(self._path, k) for k in keys]
        try:
            return await asyncio.to_thread(lambda: list(map(_exists, paths)))
        except OSError as exc:
            raise self.error(exc) from exc

    async def replace(self, key: str, data: bytes) -> None:
        try:
            await asyncio.to_thread(_rename_into_place, os.path.join(self._path, key), data)
        except OSError as exc:
            raise self.error(exc) from exc

    async def newest_write(self, prefix: str) -> float | None:
        """When the newest file under ``prefix`` was written; where it holds folders but no file (a step's
        folder made by a save that wrote nothing), when its newest folder changed, so that it goes once that
        is long ago. What vanishes meanwhile (a delete under way) does not count."""
        def stat_times(paths: Iterable[str]) -> list[float]:
            times = []
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    times.append(os.stat(path).st_mtime)
            return times

        def newest() -> float | None:
            walked = list(os.walk(os.path.join(self._path, prefix)))
            files = stat_times(os.path.join(folder, f) for folder, _dirs, names in walked for f in names)
            return max(files or stat_times(folder for folder, _dirs, _names in walked), default=None)

        try:
            return await asyncio.to_thread(newest)
        except OSError as exc:
            raise self.error(exc) from exc

    async def sync(self, keys: Iterable[str], *, files: bool = True) -> None:
        paths = [os.path.join(self._path, k) for k in keys]

        def _sync() -> None:
            dirs = set()
            for p in paths:
                dirs.add(os.path.dirname(p))
                if files:
                    _fsync_path(p)
            for d in dirs:
                _fsync_path(d)

        try:
            await asyncio.to_thread(_sync)
        except OSError as exc:
            raise self.error(exc) from exc

    async def sync_all(self) -> None:
        """One ``syncfs`` of the root's filesystem."""

        def _syncfs() -> None:
            fd = os.open(self._path, os.O_RDONLY)
            try:
                if _LIBC.syncfs(fd) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err), self._path)
            finally:
                os.close(fd)

        try:
            await asyncio.to_thread(_syncfs)
        except OSError as exc:
            raise self.error(exc) from exc

    def error(self, exc: BaseException) -> CkptdError:
        return _typed_error(self.url, exc)


def _exists(path: str) -> bool:
    """Whether ``path`` exists. Only "no such file" (or a parent that is not a folder) is "no"; any other
    failure to look (``EIO``, a stale NFS handle, ``EACCES``) raises. fsspec's ``exists`` (``os.path.exists``)
    answers False to all of them: a commit marker that could not be read would be a step never committed,
    which retention deletes and a save of its number writes over."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def _typed_error(what: str, exc: BaseException) -> CkptdError:
    """The typed error for a failure of the local filesystem; ``what`` (the root, or what was being done to
    it) starts the message. Typed errors pass through."""
    if isinstance(exc, CkptdError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return StorageNotFoundError(f"{what}: {exc}")
    if isinstance(exc, PermissionError):
        return StoragePermissionError(f"{what}: {exc}")
    full = _no_space(exc)
    if full is not None:
        return StorageFullError(f"{what}: no space left ({errno.errorcode.get(full, full)}): {exc}")
    return StorageError(f"{what}: {type(exc).__name__}: {exc}")


def _no_space(exc: BaseException | None) -> int | None:
    """The ENOSPC/EDQUOT errno of ``exc`` or of an error it wraps (zarr and fsspec re-raise), else None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _link_into_place(path: str, data: bytes) -> bool:
    """Create-once: ``data`` written aside and durable, then hard-linked to ``path`` (fails if it exists)."""
    with _aside(path, data) as tmp:
        try:
            os.link(tmp, path)
        except FileExistsError:
            with open(path, "rb") as fh:
                return fh.read() == data
    try:
        _fsync_path(os.path.dirname(path))
    except OSError:  # the name may not survive a crash: take it back, so readers find what the caller is told
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return True


def _rename_into_place(path: str, data: bytes) -> None:
    """Overwrite whole: ``data`` written aside and durable, then renamed over ``path``."""
    with _aside(path, data) as tmp:
        os.replace(tmp, path)
    _fsync_path(os.path.dirname(path))


@contextlib.contextmanager
def _aside(path: str, data: bytes) -> Iterator[str]:
    """A durable file holding ``data`` next to ``path`` (``<name>.<hex>.tmp``: readers skip such names),
    removed on the way out unless it was renamed away."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
