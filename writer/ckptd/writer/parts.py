"""The coordinator's merge of the nodes' part manifests into a step's commit manifest, and its checks: every
rank of the world saved once, the nodes agree on each array, and the arrays' shards tile them with no overlap
and no gap. Pure: :meth:`~ckptd.writer.commit.CheckpointWriter.commit` calls it on the parts it read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptd.writer.errors import ShardLayoutError
from ckptd.writer.format import (
    FORMAT_VERSION,
    ArrayRecord,
    CommitManifest,
    PartManifest,
    ShardRecord,
    check_key_tree,
    chunk_count,
)


def _check_ranks(parts: Sequence[PartManifest]) -> None:
    """Every rank of the world saved, in one node's part only (nodes told a wrong placement)."""
    where: dict[int, int] = {}
    for part in parts:
        for rank in (r for r in part.ranks if r in where):
            raise ShardLayoutError(f"step {part.step}: rank {rank} is in the parts of nodes {where[rank]} and "
                                   f"{part.node} (two processes said they were rank {rank}?)")
        where.update(dict.fromkeys(part.ranks, part.node))
    world = set(range(parts[0].world_size))
    if set(where) != world:
        extra = sorted(set(where) - world)
        raise ShardLayoutError(
            f"step {parts[0].step}: the nodes' parts hold ranks {sorted(where)[:16]} of a world of {len(world)} "
            f"(missing {sorted(world - set(where))[:16]}{f', outside it {extra[:16]}' if extra else ''}): a "
            "wrong placement? the nodes' local world sizes must add up to the world size"
        )


def merge_parts(parts: Sequence[PartManifest]) -> CommitManifest:
    """Combine node parts into the global manifest, checking that together they form whole arrays.

    Raises :class:`ShardLayoutError` when nodes disagree on an array's shape, dtype or chunk grid, or when
    the shards of an array overlap or leave gaps. Pure: the coordinator calls it on manifests it read.
    """
    if not parts:
        raise ShardLayoutError("no node parts to commit")
    first = parts[0]
    for part in parts:
        if (part.step, part.num_nodes, part.world_size) != (first.step, first.num_nodes, first.world_size):
            raise ShardLayoutError(
                f"node parts disagree: node {part.node} has step {part.step}, {part.num_nodes} nodes, world "
                f"{part.world_size}; node {first.node} has {first.step}, {first.num_nodes}, {first.world_size}"
            )
    _check_ranks(parts)
    arrays: dict[str, ArrayRecord] = {}
    shards: dict[str, list[ShardRecord]] = {}
    owner: dict[str, dict[tuple[int, ...], int]] = {}
    objects: dict[str, Any] = {}
    for part in parts:
        objects.update(part.objects)
        for rec in part.arrays:
            seen = arrays.setdefault(rec.name, rec)
            if (seen.torch_dtype, seen.shape, seen.chunks, seen.codec, seen.separator) != (
                rec.torch_dtype, rec.shape, rec.chunks, rec.codec, rec.separator
            ):
                raise ShardLayoutError(
                    f"{rec.name}: ranks disagree on the array: dtype {seen.torch_dtype} shape {seen.shape} "
                    f"chunks {seen.chunks} codec {seen.codec} chunk keys c{seen.separator}.. vs dtype "
                    f"{rec.torch_dtype} shape {rec.shape} chunks {rec.chunks} codec {rec.codec} chunk keys "
                    f"c{rec.separator}.."
                )
            taken = owner.setdefault(rec.name, {})
            for shard in rec.shards:
                for ch in shard.chunks:
                    coords = tuple(ch.coords)
                    grid = [-(-n // c) for n, c in zip(rec.shape, rec.chunks, strict=True)]
                    if len(coords) != len(grid) or any(not 0 <= x < g for x, g in zip(coords, grid, strict=True)):
                        raise ShardLayoutError(f"{rec.name}: chunk {coords} lies outside the chunk grid {grid}")
                    if coords in taken:
                        raise ShardLayoutError(
                            f"{rec.name}: chunk {coords} written by ranks {taken[coords]} and {shard.rank} "
                            "(overlapping shards)"
                        )
                    taken[coords] = shard.rank
                shards.setdefault(rec.name, []).append(shard)
    check_key_tree(arrays, saved=False)  # across nodes and ranks (each checked its own keys, merged/ too)
    merged = []
    for name in sorted(arrays):
        rec = arrays[name]
        want = chunk_count(rec.shape, rec.chunks)
        if len(owner[name]) != want:
            raise ShardLayoutError(
                f"{name}: shards cover {len(owner[name])} of {want} chunks of shape {rec.shape} (a gap: some "
                "region has no main-replica writer)"
            )
        merged.append(
            ArrayRecord(
                name, rec.torch_dtype, rec.shape, rec.chunks, sorted(shards[name], key=lambda s: s.offset), rec.codec,
                rec.separator,
            )
        )
    return CommitManifest(
        format=FORMAT_VERSION,
        step=first.step,
        num_nodes=first.num_nodes,
        world_size=first.world_size,
        arrays=merged,
        objects=objects,
        nbytes=sum(p.nbytes for p in parts),
        committed_at=0.0,
        attempts=[p.attempt for p in parts],
    )
