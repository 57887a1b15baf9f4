"""Regions ranks hold only as non-main replicas, and the coordinator's check that someone wrote them.

Only a main replica is written (a plain tensor: by rank 0). A rank that holds a non-main replica of a
region reports it; its node's part lists the ones the node did not write itself
(:attr:`~ckptd.writer.format.PartManifest.replicas`), and the coordinator refuses to commit a step in
which one of them has no main replica written by any rank, or one written with another global shape or
dtype (:func:`check_replicas`). Without this, a rank other than 0 saving a plain tensor under a key rank
0 lacks — or a replica id set wrongly everywhere — would commit a step that silently lacks the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from ckptd.writer.errors import ShardLayoutError

if TYPE_CHECKING:
    from ckptd.writer.format import ArrayRecord, PartManifest

_LISTED = 5  # keys named in an error message


class ReplicaRecord(msgspec.Struct, frozen=True, array_like=True):
    """A region that ranks of one node hold only as non-main replicas, and which the node did not write:
    stored as ``[key, dtype, global_shape, global_offset, shape, ranks]`` (compact: one per region, not
    per rank)."""

    key: str
    dtype: str
    global_shape: list[int]
    global_offset: list[int]
    shape: list[int]
    ranks: list[int]


def check_replicas(parts: Sequence[PartManifest], arrays: Mapping[str, ArrayRecord]) -> None:
    """Raise :class:`ShardLayoutError` unless every replica region the parts report lies in an array the
    step writes with the same global shape and dtype. Pure.

    ``arrays`` are the step's merged arrays (:func:`~ckptd.writer.parts.merge_parts` checked that their
    main shards tile each one whole), so a region inside such an array is covered.
    """
    missing: dict[str, set[int]] = {}
    differ: dict[str, str] = {}
    for part in parts:
        for rec in part.replicas:
            arr = arrays.get(rec.key)
            if arr is None:
                missing.setdefault(rec.key, set()).update(rec.ranks)
            elif (list(arr.shape), arr.torch_dtype) != (list(rec.global_shape), rec.dtype):
                differ.setdefault(rec.key, (
                    f"{rec.key!r} (written as {arr.torch_dtype}{tuple(arr.shape)}; ranks {sorted(rec.ranks)} "
                    f"hold a replica of {rec.dtype}{tuple(rec.global_shape)})"
                ))
            elif not _inside(rec.global_offset, rec.shape, arr.shape):
                differ.setdefault(rec.key, f"{rec.key!r} (a replica region lies outside {tuple(arr.shape)})")
    if not missing and not differ:
        return
    step = parts[0].step
    problems = []
    if missing:
        listed = ", ".join(f"{k!r} (ranks {sorted(r)})" for k, r in sorted(missing.items())[:_LISTED])
        more = f" and {len(missing) - _LISTED} more" if len(missing) > _LISTED else ""
        problems.append(
            f"{len(missing)} key(s) held only as non-main replicas, written by no rank: {listed}{more} (a plain "
            "tensor is written by rank 0 alone: save it on rank 0 too, or as Shard.per_rank / a main-replica "
            "Shard on the rank that has it)"
        )
    if differ:
        listed = ", ".join(v for _, v in sorted(differ.items())[:_LISTED])
        more = f" and {len(differ) - _LISTED} more" if len(differ) > _LISTED else ""
        problems.append(f"{len(differ)} key(s) whose replicas disagree with the main replica: {listed}{more}")
    raise ShardLayoutError(f"step {step} not committed: {'; '.join(problems)}")


def _inside(offset: Sequence[int], shape: Sequence[int], whole: Sequence[int]) -> bool:
    if not len(offset) == len(shape) == len(whole):
        return False
    return all(o >= 0 and m >= 0 and o + m <= n for o, m, n in zip(offset, shape, whole, strict=True))
