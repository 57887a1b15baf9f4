"""The staging arena: one shared-memory file in /dev/shm, pre-faulted at start and reused for every save.

Ranks copy their shards into slots of it; the daemon writes the slots to storage and frees each as soon
as its shard is durable. Space is granted as byte credits (leases): a lease is all its slots or nothing,
and a request that cannot fit waits up to its timeout. The file is created
``0600`` by the daemon's user, so no other user can map it.

The daemon holds an exclusive ``flock`` on its arena file for its whole life (the kernel drops it when the
process ends, ``kill -9`` included): :func:`remove_stale_arenas` removes only files nobody holds locked. A
lock, unlike the pid in the file's name, means the same in every PID namespace sharing ``/dev/shm``
(containers run with ``--ipc=host``) and cannot be inherited by a later process that reuses the pid.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptd.client.ownership import pid_alive
from ckptd.writer.errors import ArenaError, BackpressureError, SaveTimeoutError

log = logging.getLogger(__name__)

ALIGN = 4096
SHM_DIR = "/dev/shm"
# The longest a lease request waits for space, whatever it asks (inf: a dead client's request would wait,
# holding off leases asked ahead, as long as the arena stays full)
MAX_LEASE_WAIT_S = 3600.0
_PREFIX = "ckptd-"
_LOCKED = ".lk"  # names of arenas held under flock (earlier versions' arenas, unlocked, have no suffix)
_NAME_RE = re.compile(r"^(\d+)-[0-9a-f]+(\.lk)?$")  # after ckptd-<uid>-: <pid>-<token>[.lk]
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _slots_bytes(sizes: Sequence[int]) -> int:
    return sum(_align(max(n, 1)) for n in sizes)


def _all_fit(alloc: Allocator, sizes: Sequence[int]) -> bool:
    """Allocate every slot of ``sizes`` in ``alloc`` (a trial copy); False at the first that does not fit."""
    return all(alloc.alloc(n) is not None for n in sizes)


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    """Bytes the current user can still allocate in ``shm_dir`` (a tmpfs: this is memory, not disk)."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def check_shm_capacity(size: int, shm_dir: str = SHM_DIR) -> None:
    """Refuse an arena the shared-memory filesystem cannot hold.

    The arena file is sized with ``ftruncate``, which succeeds on tmpfs whatever its free space; the
    shortfall would surface later as a SIGBUS in the daemon or in a rank's copy. Fail at startup instead.
    """
    free = shm_free_bytes(shm_dir)
    if size > free:
        raise ArenaError(
            f"the arena ({size / 2**30:.2f} GiB) does not fit in {shm_dir} ({free / 2**30:.2f} GiB free): enlarge "
            f"{shm_dir} (docker --shm-size, a Kubernetes emptyDir with medium: Memory, or mount -o remount,size=) "
            "or lower --arena-size; `ckptd plan` tells what a model needs"
        )


class Allocator:
    """First-fit interval allocator over ``[0, size)``; frees coalesce with their neighbours."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]
        self._ends: list[int] = [size]

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def copy(self) -> Allocator:
        """An independent allocator in the same state (to try allocations on)."""
        other = Allocator(self.size)
        other._starts, other._ends = list(self._starts), list(self._ends)
        return other

    def alloc(self, n: int) -> int | None:
        n = _align(max(n, 1))
        for i, (s, e) in enumerate(zip(self._starts, self._ends, strict=True)):
            if e - s >= n:
                if e - s == n:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = s + n
                return s
        return None

    def free(self, start: int, n: int) -> None:
        end = start + _align(max(n, 1))
        i = bisect.bisect_left(self._starts, start)
        if (i > 0 and self._ends[i - 1] > start) or (i < len(self._starts) and self._starts[i] < end):
            raise ArenaError(f"double free of arena range [{start}, {end})")
        if i > 0 and self._ends[i - 1] == start:
            self._ends[i - 1] = end
            if i < len(self._starts) and self._starts[i] == end:
                self._ends[i - 1] = self._ends[i]
                del self._starts[i], self._ends[i]
        elif i < len(self._starts) and self._starts[i] == end:
            self._starts[i] = start
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, end)


@dataclass
class Lease:
    lease_id: int
    owner: int  # connection id it was granted to
    offsets: list[int]
    sizes: list[int]
    released: list[bool] = field(default_factory=list)
    ahead: bool = False  # granted for the connection's next save, not yet used by one

    def __post_init__(self) -> None:
        self.released = [False] * len(self.offsets)

    @property
    def nbytes(self) -> int:
        """The arena bytes its slots take (each rounded up to whole pages)."""
        return _slots_bytes(self.sizes)


class Arena:
    """The shared-memory staging area of one daemon."""

    def __init__(self, size: int, *, shm_dir: str = SHM_DIR, prefault: bool = True) -> None:
        if size < ALIGN:
            raise ArenaError(f"arena size {size} is below one page")
        self.size = _align(size)
        check_shm_capacity(self.size, shm_dir)
        # held open (and locked) until close(): the lock tells other daemons' cleanup this arena is live
        self.path, self._fd = _create_locked(shm_dir)
        try:
            os.ftruncate(self._fd, self.size)
            self.mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise
        self.view = memoryview(self.mm)
        if prefault:
            self._prefault()
        self._alloc = Allocator(self.size)
        self._leases: dict[int, Lease] = {}
        self._next_id = 1
        self._waiters: deque[asyncio.Future[None]] = deque()
        # Frees space kept for in-memory restore (ckptd.daemon.restore) when a lease does not fit:
        # saves always win the space. Returns the bytes it freed.
        self.on_pressure: Callable[[], int] | None = None
        # The ranges on_pressure would free: (offset, size) each
        self.evictable: Callable[[], list[tuple[int, int]]] | None = None

    def _prefault(self) -> None:
        t0 = time.perf_counter()
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, AttributeError):
            step = 64 << 20
            zeros = bytes(min(step, self.size))
            for off in range(0, self.size, step):
                n = min(step, self.size - off)
                self.view[off : off + n] = zeros[:n]
        log.info("arena %s: %d MiB pre-faulted in %.2fs", self.path, self.size >> 20, time.perf_counter() - t0)

    @property
    def free_bytes(self) -> int:
        return self._alloc.free_bytes

    @property
    def leases(self) -> int:
        return len(self._leases)

    @property
    def waiting(self) -> int:
        """Lease requests waiting for space now."""
        return len(self._waiters)

    @property
    def ahead_bytes(self) -> int:
        """Held by leases granted ahead for a connection's next save and not used yet."""
        return sum(lease.nbytes for lease in self._leases.values() if lease.ahead)

    async def lease(
        self, owner: int, sizes: list[int], timeout: float, ahead: bool = False, leave: Sequence[int] = ()
    ) -> Lease:
        """Grant slots for ``sizes`` (all or nothing), waiting FIFO up to ``timeout`` seconds. ``ahead``: for
        the connection's next save, from free space only (what :attr:`on_pressure` could free, kept steps,
        stays), never while a save waits for space (a waiter stays listed until it has run again, so space
        freed for it is not taken by a lease that only reserves), and only if slots of ``leave`` still fit
        beside it, in free space or in what :attr:`on_pressure` would free for them: the saves other ranks
        still owe a step in flight, which cannot commit without them while a lease granted ahead is held
        until its rank's next save."""
        need = _slots_bytes(sizes)
        timeout = min(timeout, MAX_LEASE_WAIT_S) if timeout >= 0 else 0.0  # (NaN: 0)
        if ahead and self._waiters:
            raise BackpressureError(f"{len(self._waiters)} save(s) waiting for staging space: none granted ahead")
        if need > self.size:
            raise ArenaError(
                f"a save of {need / 2**20:.1f} MiB cannot fit the {self.size / 2**20:.1f} MiB staging arena; "
                "start the daemon with a larger --arena-size"
            )
        deadline = time.monotonic() + timeout
        while True:
            got = self._try_alloc(sizes)
            if got is None and not ahead and self.on_pressure is not None and self.on_pressure():
                got = self._try_alloc(sizes)
            if got is not None and ahead and leave and not self._would_fit(leave):
                self._free(got, sizes)
                raise BackpressureError(
                    f"{need >> 20} MiB granted ahead would leave no room for the {len(leave)} save(s) still due "
                    "for steps in flight: none granted ahead"
                )
            if got is not None:
                lease = Lease(self._next_id, owner, got, list(sizes), ahead=ahead)
                self._next_id += 1
                self._leases[lease.lease_id] = lease
                return lease
            left = deadline - time.monotonic()
            if left <= 0:
                if timeout <= 0:
                    raise BackpressureError(
                        f"staging arena full ({self.free_bytes >> 20} MiB free, {need >> 20} MiB asked) and the "
                        "policy is fail-fast"
                    )
                raise SaveTimeoutError(
                    f"no staging space for {need >> 20} MiB within {timeout:.1f}s (arena {self.size >> 20} MiB, "
                    f"{self.free_bytes >> 20} MiB free): earlier saves are still draining"
                )
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(asyncio.shield(fut), left)
            except TimeoutError:
                pass
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)

    def _try_alloc(self, sizes: list[int]) -> list[int] | None:
        got: list[int] = []
        for n in sizes:
            off = self._alloc.alloc(n)
            if off is None:
                self._free(got, sizes)
                return None
            got.append(off)
        return got

    def _free(self, offsets: list[int], sizes: list[int]) -> None:
        for o, m in zip(offsets, sizes, strict=False):
            self._alloc.free(o, m)

    def _would_fit(self, sizes: Sequence[int]) -> bool:
        """Whether slots of ``sizes`` could be granted now, in free space or after evicting what
        :attr:`evictable` names (tried on copies of the allocator; the kept ranges are walked only when free
        space is not enough)."""
        if _all_fit(self._alloc.copy(), sizes):
            return True
        if self.evictable is None:
            return False
        trial = self._alloc.copy()
        for offset, size in self.evictable():
            trial.free(offset, size)
        return _all_fit(trial, sizes)

    def _wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)

    def get(self, lease_id: int, owner: int) -> Lease | None:
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.owner == owner else None

    def adopt(self, lease: Lease) -> None:
        """The lease now belongs to a save job, not to the connection that asked for it."""
        lease.owner = -1
        lease.ahead = False

    def release_slot(self, lease: Lease, i: int) -> None:
        if lease.released[i]:
            return
        lease.released[i] = True
        self._alloc.free(lease.offsets[i], lease.sizes[i])
        if all(lease.released):
            self._leases.pop(lease.lease_id, None)
        self._wake()

    def retain_slot(self, lease: Lease, i: int) -> tuple[int, int]:
        """Take slot ``i`` out of its lease without freeing its bytes: ``(offset, size)``, to be given back
        with :meth:`free_range` (in-memory restore keeps a committed step's staged bytes this way). Waiting
        saves are woken: what is kept, :attr:`on_pressure` can free for them."""
        lease.released[i] = True
        if all(lease.released):
            self._leases.pop(lease.lease_id, None)
        self._wake()
        return lease.offsets[i], lease.sizes[i]

    def free_range(self, offset: int, size: int) -> None:
        self._alloc.free(offset, size)
        self._wake()

    def release(self, lease: Lease) -> None:
        for i in range(len(lease.offsets)):
            self.release_slot(lease, i)
        self._leases.pop(lease.lease_id, None)

    def release_owner(self, owner: int) -> int:
        """Free every lease still held by a connection (it went away before using them)."""
        doomed = [lease for lease in self._leases.values() if lease.owner == owner]
        for lease in doomed:
            self.release(lease)
        return len(doomed)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):
            self.mm.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self._fd)  # ends the lock (with the mapping's own descriptor, if still mapped)


def _create_locked(shm_dir: str) -> tuple[str, int]:
    """A new, empty arena file ``0600``, already under this process's exclusive ``flock`` when its name
    appears: it is made under a hidden temporary name, locked, then linked to its name (``link`` never
    replaces a file), so no other daemon's :func:`remove_stale_arenas` can find it unlocked. Returns its
    path and the open descriptor that holds the lock."""
    base = f"{_PREFIX}{os.getuid()}-{os.getpid()}-"
    for _ in range(8):
        token = secrets.token_hex(4)
        tmp = os.path.join(shm_dir, f".{base}{token}.new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file only this process has opened
            path = os.path.join(shm_dir, f"{base}{token}{_LOCKED}")
            try:
                os.link(tmp, path)
            except FileExistsError:
                os.close(fd)
                continue
            return path, fd
        except BaseException:
            os.close(fd)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    raise ArenaError(f"could not pick an unused arena file name in {shm_dir}")


def remove_stale_arenas(shm_dir: str = SHM_DIR) -> list[str]:
    """Delete arena files of this user that no live daemon holds (left by ``kill -9``).

    A daemon holds its arena file under ``flock`` while it runs, so a file that can be locked here is
    nobody's, whatever the pid in its name says (the pid may be another PID namespace's, or reused since).
    A file held locked is never removed. The pid is consulted only for an arena of an earlier version
    (no ``.lk`` suffix: it was never locked): kept while a process of that pid runs here, as before.
    """
    removed = []
    prefix = f"{_PREFIX}{os.getuid()}-"
    for name in sorted(os.listdir(shm_dir)):
        m = _NAME_RE.match(name[len(prefix) :]) if name.startswith(prefix) else None
        if m is None:
            continue
        pid, locking = int(m.group(1)), bool(m.group(2))
        if not locking and (pid == os.getpid() or pid_alive(pid)):
            continue
        if _unlink_unlocked(os.path.join(shm_dir, name)):
            removed.append(name)
    return removed


def _unlink_unlocked(path: str) -> bool:
    """Unlink ``path`` if it is a regular file of this user that no process holds under ``flock``: the lock
    is taken (without waiting) and kept until the name is gone, and the name must still be that file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone meanwhile, a symlink, not ours to open
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                log.warning("cannot tell whether arena file %s is in use (flock: %s): left in place", path, exc)
            return False  # held: a live daemon's, in this PID namespace or another
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)
