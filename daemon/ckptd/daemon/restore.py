"""In-memory restore: the daemon keeps the newest committed step's staged bytes in its arena.

After a crash of the training processes (the node and its daemon live) the restarted ranks can copy the
newest committed step back from the daemon's shared memory instead of reading it from storage. When a
shard's chunks are written, :class:`Retention` keeps its arena slot (instead of freeing it) under the
step; when a step commits it becomes the kept commit and every older step's slots are freed (the previous
commit's too). "Newest" is by commit order, not by step number: after a rollback (newer steps deleted,
training resumed from an older one) the resumed steps' commits replace a larger kept number; only a step
that was already in flight when a larger one committed (steps may commit out of order) does not. When a
lease does not fit, everything kept is freed at once (:meth:`Retention.evict`, hooked to
:attr:`Arena.on_pressure`): saves always win the space. A :class:`~ckptd.client.protocol.RestoreRequest`
is answered with the arena ranges of the step's shards only while that step is the kept commit and still
whole; the client checks every chunk against the commit manifest's crc32c (an evicted and reused range
fails the check and is read from storage).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from ckptd.client.protocol import PROTOCOL_VERSION, RestoreReply, RestoreShard, ShardMeta
from ckptd.daemon.arena import Arena, Lease
from ckptd.writer.format import itemsize

log = logging.getLogger(__name__)


@dataclass
class _Kept:
    shards: list[RestoreShard] = field(default_factory=list)
    ranges: list[tuple[int, int]] = field(default_factory=list)


class Retention:
    """Staged slots kept after their write, per step; at most the newest commit plus steps in flight."""

    def __init__(self, arena: Arena, enabled: bool = True) -> None:
        self.arena = arena
        self.enabled = enabled
        self.kept: dict[int, _Kept] = {}
        self.committed: int | None = None  # the kept commit: the newest by commit order (see the module doc)
        self.committed_at = 0.0  # when it committed (time.monotonic())
        self.served = 0  # restore replies with shards (a counter for tests and logs)
        self.evictions = 0
        if enabled:
            arena.on_pressure = self.evict
            arena.evictable = self.ranges
        else:
            log.info("in-memory restore off: staged slots are freed once written; loads read storage")

    def keep(self, step: int, meta: ShardMeta, lease: Lease) -> bool:
        """Keep the written shard's slot for a restore; False (caller frees it) when retention is off."""
        if not self.enabled:
            return False
        if lease.lease_id < 0:  # a plan save's per-shard view of one span: the span is kept whole (keep_span)
            offset, size = lease.offsets[meta.slot], 0
        else:
            offset, size = self.arena.retain_slot(lease, meta.slot)
        kept = self.kept.setdefault(step, _Kept())
        shard = RestoreShard(meta.key, meta.dtype, list(meta.global_offset), list(meta.shape), offset, _nbytes(meta))
        kept.shards.append(shard)
        if size:
            kept.ranges.append((offset, size))
        return True

    def keep_span(self, step: int, span: Lease) -> bool:
        """Keep a written plan save's span (one arena lease holding all its slots: the arena frees whole
        leases only) while its step's shards are kept; False (caller releases it) when nothing of it is."""
        kept = self.kept.get(step)
        base, end = span.offsets[0], span.offsets[0] + span.sizes[0]
        if not self.enabled or kept is None or not any(base <= s.offset < end for s in kept.shards):
            return False
        kept.ranges.append(self.arena.retain_slot(span, 0))
        return True

    def ranges(self) -> list[tuple[int, int]]:
        """The arena ranges held for an in-memory restore, ``(offset, size)`` each: :meth:`evict` frees them."""
        return [r for kept in self.kept.values() for r in kept.ranges]

    @property
    def retained_bytes(self) -> int:
        """Arena bytes held for an in-memory restore (given back to any save that needs them)."""
        return sum(size for _o, size in self.ranges())

    def step_committed(self, step: int, started: float | None = None) -> None:
        """``step`` committed; ``started``: when its job began (``time.monotonic()``; None: before any
        commit). It becomes the kept commit unless a larger step committed while it was in flight (it
        lagged behind: that one stays); a smaller step started after the kept commit replaces it (training
        was rolled back and resumed from an older step). Every step below the kept commit is freed."""
        c = self.committed
        if c is None or step >= c or (started is not None and started > self.committed_at):
            if c is not None and c != step:
                self._free(c)
            c, self.committed_at = step, time.monotonic()
            self.committed = c
        for old in [s for s in self.kept if s < c]:
            self._free(old)

    @property
    def held(self) -> int | None:
        """The committed step kept for a restore now (None: nothing held)."""
        c = self.committed
        return c if c is not None and c in self.kept else None

    def step_failed(self, step: int) -> None:
        self._free(step)

    def evict(self) -> int:
        """Free everything kept (a save needs the space); returns the bytes freed."""
        freed = self.retained_bytes
        if freed:
            self.evictions += 1
            log.info("in-memory restore: %d MiB of kept steps %s evicted for a save", freed >> 20, sorted(self.kept))
        for step in list(self.kept):
            self._free(step)
        return freed

    def reply(self, step: int) -> RestoreReply:
        """The arena ranges of ``step``'s shards; none ("not held") unless it is the newest commit, kept whole
        (never with retention off)."""
        kept = self.kept.get(step)
        if kept is None or step != self.committed:
            return RestoreReply(v=PROTOCOL_VERSION, step=step, shards=[])
        self.served += 1
        return RestoreReply(v=PROTOCOL_VERSION, step=step, shards=list(kept.shards))

    def _free(self, step: int) -> None:
        kept = self.kept.pop(step, None)
        if kept is not None:
            for offset, size in kept.ranges:
                self.arena.free_range(offset, size)


def _nbytes(meta: ShardMeta) -> int:
    return math.prod(meta.shape) * itemsize(meta.dtype)
