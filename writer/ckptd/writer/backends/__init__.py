"""Storage backends: where a checkpoint root lives (a local directory, an S3 prefix), behind one interface.

Everything above this package sees a :class:`Backend`: object-level operations (get, put, create-once,
list, delete), durability (``sync``), cleanup of unfinished multipart uploads, typed errors, its own
retry counters, and the zarr ``Store`` that array metadata and reads go through. What a backend can
guarantee is stated in :class:`Capabilities` instead of being guessed from the store's type, so a new
backend has to say whether it can create an object atomically, whether writes need an fsync, and
whether crashed uploads leave anything behind.

Backends must be opened inside the running event loop that uses them (fsspec async instances bind to
the loop that made them) and closed there: ``async with await open_backend(url, options) as backend:``.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from zarr.abc.store import RangeByteRequest, Store
from zarr.core.buffer import Buffer, default_buffer_prototype

from ckptd.writer.errors import CkptdError, StorageError, StorageNotFoundError
from ckptd.writer.urls import is_local, normalize_root

if TYPE_CHECKING:
    from ckptd.writer.backends.s3 import S3Options

__all__ = [
    "Backend",
    "Capabilities",
    "RetryMetrics",
    "is_local",
    "normalize_root",
    "open_backend",
    "options_from_text",
]

@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend guarantees; the commit protocol and the writers decide by these flags alone.

    Attributes
    ----------
    atomic_create:
        :meth:`Backend.create` is atomic: of two racing writers of one key exactly one succeeds. When
        ``False`` (only where the user turned it off explicitly, e.g. S3 ``conditional_put=false`` for
        endpoints that ignore ``If-None-Match``) ``create`` checks, then writes, and racing commit
        coordinators are not excluded. ``create`` is abstract: there is no generic check-then-write
        fallback a new backend could inherit without saying so.
    needs_fsync:
        Written objects are durable only after :meth:`Backend.sync` (local files); object stores are
        durable once a PUT returns.
    multipart_cleanup:
        A writer killed mid-upload leaves invisible, billed parts that :meth:`Backend.abort_uploads`
        removes (S3 multipart uploads).
    """

    atomic_create: bool
    needs_fsync: bool
    multipart_cleanup: bool


@dataclass
class RetryMetrics:
    """What a backend's client went through: retried attempts and the faults that caused them.

    ``faults`` counts failed attempts by error code (``SlowDown``, ``Throttling``, ``InternalError``) or
    exception class (``ConnectionClosedError``, ``ReadTimeoutError``); only faults a retry may follow
    count, not ordinary answers such as a 404 to an existence check.
    """

    retries: int = 0
    faults: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> RetryMetrics:
        return RetryMetrics(self.retries, Counter(self.faults))

    def since(self, earlier: RetryMetrics) -> RetryMetrics:
        return RetryMetrics(self.retries - earlier.retries, self.faults - earlier.faults)

    def describe(self) -> str:
        kinds = ",".join(f"{k}:{n}" for k, n in sorted(self.faults.items()))
        return f"{self.retries}" + (f" ({kinds})" if kinds else "")


class Backend(ABC):
    """One checkpoint root on one kind of storage. Keys are ``/``-separated, relative to the root.

    Every method raises ckptd's typed storage errors (:meth:`error`); a missing key is ``None`` from
    :meth:`get`, not an error.
    """

    #: the root as a normalized URL (an absolute path for local roots)
    url: str
    capabilities: Capabilities
    #: retry counters of the backend's client; ``None`` where nothing is retried
    metrics: RetryMetrics | None = None

    def __init__(self, url: str, store: Store, capabilities: Capabilities) -> None:
        self.url = url
        self._store = store
        self.capabilities = capabilities

    @property
    def store(self) -> Store:
        """The zarr store at the root, for array metadata and reads (``zarr.api.asynchronous``)."""
        return self._store

    @property
    def local_root(self) -> str | None:
        """The root's directory where raw file I/O applies (``writev``, ``fsync``); ``None`` otherwise."""
        return None

    # --- objects ----------------------------------------------------------------------------------
    async def get(self, key: str) -> bytes | None:
        """The object's bytes, or ``None`` if it does not exist."""
        try:
            buf = await self._store.get(key, prototype=default_buffer_prototype())
        except Exception as exc:
            raise self.error(exc) from exc
        return None if buf is None else buf.to_bytes()

    async def read_into(self, key: str, start: int, bufs: Sequence[memoryview]) -> tuple[int, int | None]:
        """Read bytes ``[start, start + total length of bufs)`` of ``key`` into ``bufs``, in order.

        Returns ``(bytes read, the object's size or None if unknown)``; fewer bytes than asked where the
        object is shorter. A missing object raises :class:`~ckptd.writer.errors.StorageNotFoundError`.
        Backends that can stream a ranged read into memory override this (S3); the default reads the range
        through the zarr store and copies it."""
        want = sum(b.nbytes for b in bufs)
        try:
            buf = await self._store.get(key, default_buffer_prototype(), RangeByteRequest(start, start + want))
        except Exception as exc:
            raise self.error(exc) from exc
        if buf is None:
            raise StorageNotFoundError(f"{key}: no such object under {self.url}")
        data = memoryview(buf.to_bytes())
        pos = 0
        for b in bufs:
            n = min(b.nbytes, data.nbytes - pos)
            b[:n] = data[pos : pos + n]
            pos += n
        return pos, None

    async def put(self, key: str, data: bytes) -> None:
        """Write (or overwrite) one object."""
        try:
            await self._store.set(key, _buffer(data))
        except Exception as exc:
            raise self.error(exc) from exc

    async def replace(self, key: str, data: bytes) -> None:
        """Write (or overwrite) one object whole: a reader sees the old bytes or the new, never part of them,
        even when the writer dies mid-write. An object store's PUT is whole (the default); a local file is
        written aside, made durable and renamed into place (:class:`~.local.LocalBackend`)."""
        await self.put(key, data)

    async def put_body(self, key: str, body: bytearray) -> None:
        """Write a large object the backend may send without further copies (default: :meth:`put`)."""
        await self.put(key, bytes(body))

    @abstractmethod
    async def create(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data`` unless it exists (create-once, see :class:`Capabilities`).

        ``True`` if it now holds ``data`` because of this call (or an identical earlier write),
        ``False`` if another writer created it first with other bytes.
        """

    async def exists(self, key: str) -> bool:
        try:
            return await self._store.exists(key)
        except Exception as exc:
            raise self.error(exc) from exc

    async def exists_all(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`exists` of each of ``keys``, probed at once (on S3 one round trip's latency, not one each)."""
        return list(await asyncio.gather(*map(self.exists, keys)))

    async def delete(self, key: str) -> None:
        """Remove one object; a missing one is not an error."""
        try:
            await self._store.delete(key)
        except Exception as exc:
            raise self.error(exc) from exc

    async def delete_prefix(self, prefix: str) -> None:
        """Remove every object under ``prefix``."""
        try:
            await self._store.delete_dir(prefix)
        except Exception as exc:
            raise self.error(exc) from exc

    async def list_dir(self, prefix: str) -> list[str]:
        """Names of the immediate children under ``prefix`` (``""`` is the root), without slashes."""
        try:
            return [name.rstrip("/") async for name in self._store.list_dir(prefix)]
        except Exception as exc:
            raise self.error(exc) from exc

    async def newest_write(self, prefix: str) -> float | None:
        """When the newest object under ``prefix`` was written (seconds since the epoch); ``None`` when
        nothing is there or the backend cannot tell (``ckptd gc`` then keeps an unfinished step)."""
        return None

    # --- durability and cleanup -------------------------------------------------------------------
    async def sync(self, keys: Iterable[str], *, files: bool = True) -> None:
        """Make written objects durable (their files unless ``files=False``: synced as written; and
        their folders). A no-op unless ``capabilities.needs_fsync``."""
        self._no_sync("sync")

    async def sync_all(self) -> None:
        """Make everything written under the root durable at once (for jobs writing many small
        objects, where one fsync each is slow). A no-op unless ``capabilities.needs_fsync``."""
        self._no_sync("sync_all")

    def _no_sync(self, method: str) -> None:
        if self.capabilities.needs_fsync:  # a backend that declares the need must implement it
            raise StorageError(f"{type(self).__name__} declares needs_fsync but does not implement {method}")

    async def abort_uploads(self, prefix: str) -> int:
        """Abort unfinished multipart uploads under ``prefix``; how many. 0 unless
        ``capabilities.multipart_cleanup``."""
        return 0

    # --- errors and lifecycle ---------------------------------------------------------------------
    @abstractmethod
    def error(self, exc: BaseException) -> CkptdError:
        """The typed ckptd error for a failure of this storage (``raise backend.error(e) from e``);
        already-typed errors pass through."""

    async def close(self) -> None:
        """Release network clients; idempotent."""
        return None  # nothing to release unless a backend holds a client

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def open_backend(
    root: str, options: Mapping[str, Any] | S3Options | None = None, *, create: bool = True
) -> Backend:
    """The backend for ``root`` (a path, ``file://`` or ``s3://`` URL), opened in the running loop.

    ``create=False`` refuses a local root that does not exist (:class:`StorageNotFoundError`); S3
    roots check their bucket (one HEAD) either way, so a missing bucket or denied access fails here,
    typed, not on the first write. ``options`` are the S3 options (typed values; see
    :class:`~ckptd.writer.backends.s3.S3Options`), :class:`~ckptd.writer.errors.ConfigError` if
    unknown or of the wrong type. Close the result (``async with``).
    """
    url = normalize_root(root)
    scheme = urlparse(url).scheme
    if scheme == "":
        from ckptd.writer.backends.local import LocalBackend

        return LocalBackend.open(url, create=create)
    if scheme == "s3":
        from ckptd.writer.backends.s3 import S3Backend

        return await S3Backend.open(url, options)
    raise StorageError(f"unsupported checkpoint root {root!r}: use a local path, file:// or s3://")


def options_from_text(values: Mapping[str, str]) -> dict[str, Any]:
    """Typed storage options from text (``--storage-option KEY=VALUE``, environment): ``"false"`` ->
    ``False``, ``"3"`` -> ``3``. :class:`~ckptd.writer.errors.ConfigError` for unknown keys and values
    that do not parse."""
    if not values:
        return {}
    from ckptd.writer.backends.s3 import S3Options

    return S3Options.typed_from_text(values)


def _buffer(data: bytes) -> Buffer:
    return default_buffer_prototype().buffer.from_bytes(data)
