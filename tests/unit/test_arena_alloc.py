"""The staging arena: the interval allocator (pure), the shared-memory file and byte-credit leases."""

from __future__ import annotations

import asyncio
import mmap
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ckptd.daemon.arena import ALIGN, Allocator, Arena, remove_stale_arenas
from ckptd.writer.errors import ArenaError, BackpressureError, CkptdError, SaveTimeoutError

PAGE = ALIGN
MiB = 1 << 20


def aligned(n: int) -> int:
    return -(-max(n, 1) // ALIGN) * ALIGN


# --- Allocator ------------------------------------------------------------------------------------
class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free sequences checked against a model: the live ranges and their complement."""

    @initialize(pages=st.integers(1, 32))
    def setup(self, pages: int) -> None:
        self.size = pages * PAGE
        self.alloc = Allocator(self.size)
        self.live: dict[int, int] = {}  # start -> requested bytes

    def gaps(self) -> list[tuple[int, int]]:
        out, pos = [], 0
        for start in sorted(self.live):
            if start > pos:
                out.append((pos, start))
            pos = start + aligned(self.live[start])
        if pos < self.size:
            out.append((pos, self.size))
        return out

    @rule(n=st.integers(0, 40 * PAGE))
    def alloc_bytes(self, n: int) -> None:
        need = aligned(n)
        fits = [s for s, e in self.gaps() if e - s >= need]
        got = self.alloc.alloc(n)
        if not fits:
            assert got is None
            return
        assert got == fits[0]  # first fit
        assert got % ALIGN == 0 and got + need <= self.size
        for s, m in self.live.items():
            assert got + need <= s or s + aligned(m) <= got, "overlapping ranges handed out"
        self.live[got] = n

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_one(self, data: st.DataObject) -> None:
        start = data.draw(st.sampled_from(sorted(self.live)))
        n = self.live.pop(start)
        self.alloc.free(start, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        start = data.draw(st.sampled_from(sorted(self.live)))
        n = self.live.pop(start)
        self.alloc.free(start, n)
        before = self.alloc.free_bytes
        with pytest.raises(ArenaError, match="double free"):
            self.alloc.free(start, n)
        assert self.alloc.free_bytes == before

    @invariant()
    def free_list_is_the_coalesced_complement(self) -> None:
        # white-box: the free list holds exactly the maximal gaps, so neighbours were merged
        assert list(zip(self.alloc._starts, self.alloc._ends, strict=True)) == self.gaps()
        assert self.alloc.free_bytes == self.size - sum(aligned(n) for n in self.live.values())

    def teardown(self) -> None:
        for start, n in list(self.live.items()):
            self.alloc.free(start, n)
        assert self.alloc.free_bytes == self.size
        assert self.alloc.alloc(self.size) == 0  # one range of the full size again


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


@given(st.lists(st.integers(0, 3 * PAGE), min_size=1, max_size=30), st.randoms())
def test_freeing_everything_in_any_order_restores_one_full_range(sizes: list[int], rnd: object) -> None:
    size = 64 * PAGE
    alloc = Allocator(size)
    got = [(alloc.alloc(n), n) for n in sizes]
    held = [(o, n) for o, n in got if o is not None]
    rnd.shuffle(held)  # type: ignore[attr-defined]
    for o, n in held:
        alloc.free(o, n)
    assert alloc.free_bytes == size
    assert alloc._starts == [0] and alloc._ends == [size]


def test_allocations_are_page_aligned_and_zero_takes_a_page() -> None:
    alloc = Allocator(4 * PAGE)
    assert alloc.alloc(0) == 0
    assert alloc.alloc(1) == PAGE
    assert alloc.alloc(PAGE + 1) == 2 * PAGE
    assert alloc.alloc(1) is None
    assert alloc.free_bytes == 0


@pytest.mark.parametrize(
    ("start", "n"),
    [
        (0, PAGE),  # exactly a free range
        (4 * PAGE, PAGE),  # the head of the free tail
        (5 * PAGE, PAGE),  # inside the free tail
        (3 * PAGE, 2 * PAGE),  # straddles allocated and free space
        (0, 3 * PAGE),  # runs from free into allocated space
    ],
)
def test_freeing_free_space_is_refused(start: int, n: int) -> None:
    alloc = Allocator(8 * PAGE)
    assert alloc.alloc(4 * PAGE) == 0
    alloc.free(0, PAGE)  # now [0, 1p) and [4p, 8p) are free
    with pytest.raises(ArenaError, match="double free"):
        alloc.free(start, n)
    assert alloc.free_bytes == 5 * PAGE


def test_free_coalesces_with_both_neighbours() -> None:
    alloc = Allocator(3 * PAGE)
    a, b, c = alloc.alloc(PAGE), alloc.alloc(PAGE), alloc.alloc(PAGE)
    assert (a, b, c) == (0, PAGE, 2 * PAGE)
    alloc.free(0, PAGE)
    alloc.free(2 * PAGE, PAGE)
    assert alloc.alloc(2 * PAGE) is None  # two separate pages, not one range
    alloc.free(PAGE, PAGE)
    assert alloc.alloc(3 * PAGE) == 0


# --- Arena: the shared-memory file ----------------------------------------------------------------
@pytest.fixture
def arena(tmp_path: Path) -> Iterator[Arena]:
    a = Arena(MiB, shm_dir=str(tmp_path), prefault=False)
    try:
        yield a
    finally:
        a.close()


def test_arena_file_is_private_and_removed_on_close() -> None:
    a = Arena(MiB, prefault=True)  # the real /dev/shm, pre-faulted
    try:
        assert os.path.dirname(a.path) == "/dev/shm"
        st_ = os.stat(a.path)
        assert stat.S_IMODE(st_.st_mode) == 0o600
        assert st_.st_uid == os.getuid()
        assert st_.st_size == MiB == a.size == a.free_bytes
    finally:
        a.close()
    assert not os.path.exists(a.path)
    a.close()  # idempotent


def test_arena_is_shared_with_other_mappings(arena: Arena) -> None:
    """A rank maps the same file: bytes it writes are what the daemon reads."""
    with open(arena.path, "r+b") as fh, mmap.mmap(fh.fileno(), arena.size) as other:
        other[PAGE : PAGE + 5] = b"hello"
        assert bytes(arena.view[PAGE : PAGE + 5]) == b"hello"
        arena.view[0:3] = b"abc"
        assert other[0:3] == b"abc"


def test_arena_size_is_rounded_to_pages_and_must_hold_one(tmp_path: Path) -> None:
    a = Arena(PAGE + 1, shm_dir=str(tmp_path), prefault=False)
    try:
        assert a.size == 2 * PAGE
        assert os.path.getsize(a.path) == 2 * PAGE
    finally:
        a.close()
    with pytest.raises(ArenaError):
        Arena(PAGE - 1, shm_dir=str(tmp_path), prefault=False)
    assert os.listdir(tmp_path) == []


# --- Arena: leases --------------------------------------------------------------------------------
async def test_lease_grants_disjoint_slots_and_release_returns_them(arena: Arena) -> None:
    lease = await arena.lease(1, [10, PAGE, 3 * PAGE + 1, 0], timeout=0)
    assert lease.offsets == [0, PAGE, 2 * PAGE, 6 * PAGE]
    assert lease.sizes == [10, PAGE, 3 * PAGE + 1, 0]
    assert arena.free_bytes == MiB - 7 * PAGE
    assert arena.leases == 1
    assert arena.get(lease.lease_id, 1) is lease
    assert arena.get(lease.lease_id, 2) is None  # another connection's
    arena.release(lease)
    assert arena.free_bytes == MiB
    assert arena.leases == 0
    assert arena.get(lease.lease_id, 1) is None


async def test_lease_is_all_or_nothing(arena: Arena) -> None:
    held = await arena.lease(1, [MiB - 6 * PAGE], timeout=0)
    with pytest.raises(BackpressureError):
        await arena.lease(2, [4 * PAGE, 4 * PAGE], timeout=0)  # the first slot fits, the second not
    assert arena.free_bytes == 6 * PAGE  # the first slot was given back
    assert arena.leases == 1
    got = await arena.lease(2, [3 * PAGE, 3 * PAGE], timeout=0)
    assert arena.free_bytes == 0
    arena.release(held)
    arena.release(got)
    assert arena.free_bytes == MiB


async def test_a_lease_asked_for_ahead_leaves_room_for_the_saves_still_due(arena: Arena) -> None:
    """Granted ahead only when the slots of ``leave`` still fit beside it, contiguous where they must be;
    a refusal gives everything back."""
    held = await arena.lease(1, [MiB // 2], timeout=0)
    with pytest.raises(BackpressureError, match="still due"):
        await arena.lease(1, [MiB // 4], timeout=0, ahead=True, leave=[MiB // 4 + 1])
    assert (arena.free_bytes, arena.leases, arena.ahead_bytes) == (MiB // 2, 1, 0)
    small = await arena.lease(1, [MiB // 4], timeout=0, ahead=True, leave=[MiB // 8, MiB // 8])
    assert (arena.free_bytes, arena.ahead_bytes) == (MiB // 4, MiB // 4)
    arena.release(small)
    hole = await arena.lease(2, [MiB // 8], timeout=0)  # splits the free half in two eighths around it
    rest = await arena.lease(2, [MiB // 8], timeout=0)
    arena.release(hole)  # free: an eighth at the hole, a quarter at the end
    with pytest.raises(BackpressureError):  # 5/16 due: as many bytes as are left free, but not in one run
        await arena.lease(1, [MiB // 16], timeout=0, ahead=True, leave=[5 * MiB // 16])
    assert arena.free_bytes == 3 * MiB // 8
    for lease in (held, rest):
        arena.release(lease)
    assert arena.free_bytes == MiB
    kept = await arena.lease(3, [MiB // 2], timeout=0)  # stands for bytes kept for an in-memory restore
    with pytest.raises(BackpressureError, match="still due"):
        await arena.lease(1, [MiB // 2], timeout=0, ahead=True, leave=[MiB // 2])
    arena.evictable = lambda: [(kept.offsets[0], MiB // 2)]  # ... which a due save would evict
    ahead = await arena.lease(1, [MiB // 2], timeout=0, ahead=True, leave=[MiB // 2])
    assert (arena.free_bytes, arena.ahead_bytes) == (0, MiB // 2)
    arena.evictable = None
    for lease in (kept, ahead):
        arena.release(lease)


async def test_a_lease_larger_than_the_arena_fails_at_once(arena: Arena) -> None:
    t0 = time.monotonic()
    with pytest.raises(ArenaError, match="larger --arena-size"):
        await arena.lease(1, [MiB // 2, MiB // 2 + 1], timeout=30)
    assert time.monotonic() - t0 < 10  # not its 30 s timeout (a loaded runner may pause this process a moment)
    assert issubclass(ArenaError, CkptdError) and issubclass(ArenaError, MemoryError)
    assert arena.free_bytes == MiB


async def test_full_arena_with_zero_timeout_is_backpressure(arena: Arena) -> None:
    await arena.lease(1, [MiB], timeout=0)
    with pytest.raises(BackpressureError) as info:
        await arena.lease(2, [1], timeout=0)
    assert isinstance(info.value, BlockingIOError)


async def test_full_arena_with_a_timeout_times_out(arena: Arena) -> None:
    await arena.lease(1, [MiB], timeout=0)
    t0 = time.monotonic()
    with pytest.raises(SaveTimeoutError) as info:
        await arena.lease(2, [PAGE], timeout=0.2)
    waited = time.monotonic() - t0
    assert 0.18 <= waited < 10  # its 0.2 s (not a wait for space that never comes), however loaded the runner
    assert isinstance(info.value, TimeoutError)
    assert not arena._waiters  # the waiter cleaned up after itself


async def test_a_waiter_is_granted_when_space_is_released(arena: Arena) -> None:
    first = await arena.lease(1, [MiB // 2, MiB // 2], timeout=0)
    waiter = asyncio.create_task(arena.lease(2, [MiB // 2 + PAGE], timeout=5))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    arena.release_slot(first, 0)  # half the arena is not enough
    await asyncio.sleep(0.05)
    assert not waiter.done()
    t0 = time.monotonic()
    arena.release_slot(first, 1)
    granted = await asyncio.wait_for(waiter, 1)
    assert time.monotonic() - t0 < 0.5
    assert granted.offsets == [0] and granted.owner == 2
    assert arena.get(first.lease_id, 1) is None  # fully released leases are forgotten
    assert arena.free_bytes == MiB - (MiB // 2 + PAGE)


async def test_several_waiters_are_all_served_as_space_frees(arena: Arena) -> None:
    held = await arena.lease(1, [PAGE] * 4 + [MiB - 4 * PAGE], timeout=0)
    waiters = [asyncio.create_task(arena.lease(10 + i, [PAGE], timeout=5)) for i in range(4)]
    await asyncio.sleep(0.02)
    assert not any(w.done() for w in waiters)
    for i in range(4):
        arena.release_slot(held, i)
    granted = await asyncio.wait_for(asyncio.gather(*waiters), 2)
    assert sorted(g.offsets[0] for g in granted) == [0, PAGE, 2 * PAGE, 3 * PAGE]


async def test_cancelled_waiter_leaves_nothing_behind(arena: Arena) -> None:
    await arena.lease(1, [MiB], timeout=0)
    waiter = asyncio.create_task(arena.lease(2, [PAGE], timeout=5))
    await asyncio.sleep(0.02)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not arena._waiters
    assert arena.leases == 1


async def test_release_slot_is_idempotent(arena: Arena) -> None:
    lease = await arena.lease(1, [PAGE, PAGE], timeout=0)
    arena.release_slot(lease, 0)
    arena.release_slot(lease, 0)  # no double free
    assert arena.free_bytes == MiB - PAGE
    arena.release(lease)
    arena.release(lease)
    assert arena.free_bytes == MiB


async def test_release_owner_frees_a_connections_unused_leases(arena: Arena) -> None:
    a1 = await arena.lease(7, [PAGE], timeout=0)
    a2 = await arena.lease(7, [2 * PAGE, PAGE], timeout=0)
    adopted = await arena.lease(7, [PAGE], timeout=0)
    arena.adopt(adopted)  # a save job owns it now; the connection going away must not free it
    other = await arena.lease(8, [PAGE], timeout=0)
    assert arena.release_owner(7) == 2
    assert arena.get(a1.lease_id, 7) is None and arena.get(a2.lease_id, 7) is None
    assert arena.get(other.lease_id, 8) is other
    assert arena.leases == 2
    assert arena.free_bytes == MiB - 2 * PAGE
    assert arena.release_owner(7) == 0
    arena.release(adopted)
    arena.release(other)
    assert arena.free_bytes == MiB


# --- stale arenas ---------------------------------------------------------------------------------
def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as fh:
        return int(fh.read()) + 1000  # above pid_max: no process can have it


def test_remove_stale_arenas_removes_only_this_users_dead_daemons(tmp_path: Path) -> None:
    uid = os.getuid()
    names = {
        "dead": f"ckptd-{uid}-{_dead_pid()}-0a1b2c3d",
        "self": f"ckptd-{uid}-{os.getpid()}-0a1b2c3d",
        "live": f"ckptd-{uid}-{os.getppid()}-0a1b2c3d",
        "init": f"ckptd-{uid}-1-0a1b2c3d",
        "other_user": f"ckptd-{uid + 1}-{_dead_pid()}-0a1b2c3d",
        "not_a_pid": f"ckptd-{uid}-abc-0a1b2c3d",
        "unrelated": "something-else",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_arenas(str(tmp_path)) == [names["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if k != "dead")
    assert remove_stale_arenas(str(tmp_path)) == []


def test_remove_stale_arenas_keeps_a_running_arena(tmp_path: Path) -> None:
    a = Arena(PAGE, shm_dir=str(tmp_path), prefault=False)
    try:
        assert remove_stale_arenas(str(tmp_path)) == []
        assert os.path.exists(a.path)
    finally:
        a.close()


def _holder(code: str, *args: str) -> subprocess.Popen[str]:
    """A Python child running ``code`` (it prints one line once ready, then waits for its stdin to close)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout is not None
    assert proc.stdout.readline().strip(), "the child did not start"
    return proc


_HOLD_FLOCK = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_SH); "
               "print('locked', flush=True); sys.stdin.read()")


def test_remove_stale_arenas_judges_by_the_lock_not_by_the_pid(tmp_path: Path) -> None:
    """A daemon holds its arena file under flock: a held file stays whatever its pid says (a daemon of
    another PID namespace sharing /dev/shm looks dead here), an unheld one goes whatever its pid says (a
    pid reused after kill -9 looks alive). An arena of an earlier version (no ``.lk``, never locked) keeps
    the pid rule, and a lock protects it too."""
    uid = os.getuid()
    names = {
        "held_dead_pid": f"ckptd-{uid}-{_dead_pid()}-0a1b2c3d.lk",
        "held_old_dead_pid": f"ckptd-{uid}-{_dead_pid()}-1a1b2c3d",
        "free_live_pid": f"ckptd-{uid}-{os.getppid()}-2a1b2c3d.lk",
        "free_dead_pid": f"ckptd-{uid}-{_dead_pid()}-3a1b2c3d.lk",
        "free_old_live_pid": f"ckptd-{uid}-{os.getppid()}-4a1b2c3d",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    holders = [_holder(_HOLD_FLOCK, str(tmp_path / names[k])) for k in ("held_dead_pid", "held_old_dead_pid")]
    try:
        assert remove_stale_arenas(str(tmp_path)) == sorted([names["free_live_pid"], names["free_dead_pid"]])
        left = {"held_dead_pid", "held_old_dead_pid", "free_old_live_pid"}
        assert sorted(os.listdir(tmp_path)) == sorted(names[k] for k in left)
    finally:
        for proc in holders:
            proc.communicate(timeout=30)
    # the holders are gone (their locks with them): the unheld new-style arena goes; the old one's pid lives
    assert remove_stale_arenas(str(tmp_path)) == sorted([names["held_dead_pid"], names["held_old_dead_pid"]])


def test_an_arena_is_locked_while_its_daemon_lives_and_removed_after_kill_9(tmp_path: Path) -> None:
    """The whole life of an arena file: locked from the moment its name appears, kept by another process's
    cleanup while its daemon runs, removed once that daemon was killed (SIGKILL: no cleanup of its own)."""
    proc = _holder("import sys; from ckptd.daemon.arena import Arena; "
                   "a = Arena(4096, shm_dir=sys.argv[1], prefault=False); print(a.path, flush=True); sys.stdin.read()",
                   str(tmp_path))
    try:
        (name,) = os.listdir(tmp_path)  # no temporary file left next to it
        assert name.endswith(".lk")
        assert remove_stale_arenas(str(tmp_path)) == []
        assert os.listdir(tmp_path) == [name]
    finally:
        proc.kill()
        proc.wait()
    assert remove_stale_arenas(str(tmp_path)) == [name]
    assert os.listdir(tmp_path) == []
