"""In-memory restore, client side: copy the newest committed step back from the daemon's arena.

The daemon keeps the staged bytes of its newest committed step (``ckptd.daemon.restore``). A load on the
same node asks for them (:class:`~ckptd.client.protocol.RestoreRequest`): the reply lists, per shard its
ranks staged, the key, region and arena range. :class:`ArenaSource` answers the loader's lookups; the
loader (:class:`~ckptd.client.fastread.ChunkReader`) copies a region from the arena only when it is
exactly a staged shard, and then checks every chunk's crc32c against the commit manifest read from
storage, so a stale copy (another step's bytes, a range evicted and reused by a save) is caught; such
regions, and everything the arena does not hold, are read from storage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptd.client.protocol import PROTOCOL_VERSION, RestoreReply, RestoreRequest, RestoreShard
from ckptd.writer.errors import CkptdError

if TYPE_CHECKING:
    from ckptd.client.client import CheckpointClient

log = logging.getLogger(__name__)

Where = tuple[str, tuple[int, ...], tuple[int, ...]]  # (key, global offset, shape)


@dataclass
class ArenaSource:
    """The arena ranges holding one step's staged shards, and what a load took from them."""

    step: int
    view: memoryview  # the whole arena, mapped by this process
    shards: dict[Where, RestoreShard]
    served_bytes: int = 0  # copied from memory and verified
    rejected: list[str] = field(default_factory=list)  # keys whose copy failed its checksum

    def find(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> RestoreShard | None:
        return self.shards.get((key, offset, shape))


def arena_source(client: CheckpointClient, step: int) -> ArenaSource | None:
    """What the client's daemon holds of ``step`` in memory; None when nothing (or no daemon answers)."""
    try:
        reply = client._request(RestoreRequest(v=PROTOCOL_VERSION, step=step))
    except CkptdError as exc:  # an older daemon, or none: storage serves the load
        log.info("in-memory restore of step %d unavailable: %s", step, exc)
        return None
    arena = client._staging.mm
    if not isinstance(reply, RestoreReply) or not reply.shards or arena is None:
        return None
    view = memoryview(arena)
    shards = {
        (s.key, tuple(s.global_offset), tuple(s.shape)): s
        for s in reply.shards
        if s.offset >= 0 and s.offset + s.nbytes <= view.nbytes
    }
    return ArenaSource(step, view, shards) if shards else None
