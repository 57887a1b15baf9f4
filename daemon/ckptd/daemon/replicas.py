"""The non-main replica regions a node's ranks report, checked on arrival and summed up for the node part.

A rank writes only main replicas; the regions it holds only as non-main replicas (every plain tensor on
a rank other than 0) come with its save, or once with its registered plan. The node part lists those the
node did not write itself, one record per region with the ranks that hold it; the coordinator checks
that some rank wrote each (:func:`ckptd.writer.replicas.check_replicas`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ckptd.client.protocol import ReplicaMeta
from ckptd.daemon.job import RankSave
from ckptd.writer.format import check_region, itemsize, validate_key
from ckptd.writer.replicas import ReplicaRecord


def check_replica_metas(replicas: Sequence[ReplicaMeta]) -> None:
    """Valid keys and dtypes, regions inside their arrays (what a replica's main must then cover)."""
    for r in replicas:
        validate_key(r.key)
        itemsize(r.dtype)
        # a grid of ones: the region's bounds and rank are checked, any block is on the grid
        check_region(r.key, r.global_shape, r.global_offset, r.shape, [1] * len(r.global_shape))


def node_replicas(saves: Iterable[RankSave]) -> list[ReplicaRecord]:
    """The replica regions of the node's saves that the node did not write itself (no main shard of the
    same key, global shape and dtype here), one record per region with the ranks holding it, sorted.

    A key the node wrote as a main replica is written whole or the commit fails on its gap, so only the
    others need the coordinator's look; a key written here with another shape or dtype stays listed, and
    the coordinator names the disagreement.
    """
    saves = list(saves)
    written = {(m.key, m.dtype, tuple(m.global_shape)) for s in saves for m in s.request.shards}
    held: dict[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for save in saves:
        for r in save.request.replicas:
            gshape = tuple(r.global_shape)
            if (r.key, r.dtype, gshape) not in written:
                where = (r.key, r.dtype, gshape, tuple(r.global_offset), tuple(r.shape))
                held.setdefault(where, []).append(save.request.rank)
    return [
        ReplicaRecord(key, dtype, list(g), list(o), list(s), sorted(set(ranks)))
        for (key, dtype, g, o, s), ranks in sorted(held.items())
    ]
