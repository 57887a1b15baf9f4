"""The Megatron layout sidecar's schema: which param sits where in which bucket, and where in model space.

Megatron's checkpoints do not record the distributed optimizer's grad-buffer layout (``param_index_map``,
``bucket_indices``) nor where each param's pieces sit in model space, yet the offline merge and a load
into another parallel layout need exactly that. Each saving rank stores its :class:`MegatronLayout` once
per run as a content-addressed sidecar (``_ckptd/_sidecars/<sha256>.json``), named in its ``megatron`` record.

Pure data: frozen ``msgspec`` structs, no torch, no I/O. :func:`encode_layout` writes compact JSON with
sorted keys (the sidecar's content address depends on these bytes); :func:`decode_layout` checks the
version first. Building a layout from live Megatron objects is the client's business
(``ckptd.client.megatron.layout``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import msgspec
import numpy as np

from ckptd.writer.errors import CorruptCheckpointError, InvalidRequestError
from ckptd.writer.format import MEGATRON_LAYOUT_VERSION, MODEL_PREFIX, OPTIM_PREFIX, bucket_key, bucket_prefix
from ckptd.writer.format import model_key as _model_key

__all__ = [
    "BucketLayout",
    "BufferLayout",
    "MegatronLayout",
    "ModelPiece",
    "ParamLayout",
    "decode_layout",
    "encode_layout",
]


class ModelPiece(msgspec.Struct, frozen=True):
    """Where (part of) a param lives in model space: one built ``ShardedTensor`` of the model.

    The piece is ``param.as_strided(view_shape, view_stride, view_offset)`` (offsets in elements
    relative to the param's first element), reshaped to ``(1,) * prepend_axis_num + view_shape`` and
    placed at ``global_offset`` of the array ``key`` of shape ``global_shape``. A factory such as
    SwiGLU's ``linear_fc1`` yields two pieces of one param.
    """

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend_axis_num: int
    view_offset: int
    view_shape: tuple[int, ...]
    view_stride: tuple[int, ...]
    replica_id: tuple[int, ...]

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The piece's extent in the global array (``prepend_axis_num`` leading axes of extent 1)."""
        return (1,) * self.prepend_axis_num + self.view_shape

    def region(self) -> tuple[slice, ...]:
        """The piece's region in the global array."""
        return tuple(slice(o, o + n) for o, n in zip(self.global_offset, self.stored_shape, strict=True))


class ParamLayout(msgspec.Struct, frozen=True):
    """One param in a grad buffer.

    ``start``/``end``/``bucket_id`` are Megatron's ``param_index_map`` (whole-buffer coordinates).
    ``group_index``/``group_order`` locate the param's main shard in the inner optimizer's param groups
    on *this* DP rank (None where this rank holds no slice of the param).
    """

    name: str
    start: int
    end: int
    bucket_id: int
    shape: tuple[int, ...]
    model_pieces: tuple[ModelPiece, ...]
    group_index: int | None = None
    group_order: int | None = None

    def uncovered(self) -> tuple[int, int] | None:
        """The first range ``[lo, hi)`` of the flattened param that none of its model pieces views, or None
        when they cover it all. State there is in no model array, so a merge or a load at another layout
        would leave it unwritten: callers refuse such a param (once per param: an interval union)."""
        numel = math.prod(self.shape)
        if numel == 0:
            return None
        runs = [_runs(piece) for piece in self.model_pieces]
        if sum(len(starts) for starts, _n in runs) <= 64:  # the common case: a few contiguous pieces
            reach = 0
            for lo, hi in sorted((int(a), int(a) + n) for starts, n in runs for a in starts):
                if lo > reach:
                    return reach, lo
                reach = max(reach, hi)
            return (reach, numel) if reach < numel else None
        starts = np.concatenate([st for st, _n in runs])  # many runs (a column piece has one a row): in numpy
        ends = np.concatenate([st + n for st, n in runs])
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
        reach_all = np.maximum.accumulate(ends)  # how far the runs up to each one reach
        before = np.concatenate(([0], reach_all[:-1]))
        gaps = np.flatnonzero(starts > before)
        if gaps.size:
            return int(before[gaps[0]]), int(starts[gaps[0]])
        return (int(reach_all[-1]), numel) if reach_all[-1] < numel else None


def _runs(piece: ModelPiece) -> tuple[np.ndarray, int]:
    """The flat elements of the param that ``piece`` views, as runs: (their starts, the runs' length)."""
    dims = sorted(((n, s) for n, s in zip(piece.view_shape, piece.view_stride, strict=True) if n != 1),
                  key=lambda d: -d[1])
    if any(n == 0 for n, _s in dims):
        return np.zeros(0, np.int64), 0
    folded: list[tuple[int, int]] = []  # an axis whose stride spans the next one's extent is one with it
    for n, s in dims:
        if folded and folded[-1][1] == n * s:
            folded[-1] = (folded[-1][0] * n, s)
        else:
            folded.append((n, s))
    run = folded.pop()[0] if folded and folded[-1][1] == 1 else 1
    starts = np.array([piece.view_offset], dtype=np.int64)
    for n, s in folded:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
    return starts, run


class BucketLayout(msgspec.Struct, frozen=True):
    """One bucket of a grad buffer; ``start``/``end`` in buffer coordinates, params ordered by start."""

    index: int
    start: int
    end: int
    numel_unpadded: int
    params: tuple[ParamLayout, ...]

    @property
    def padded_numel(self) -> int:
        return self.end - self.start


class BufferLayout(msgspec.Struct, frozen=True):
    """One grad buffer of a (chained) DistributedOptimizer, as seen from one DP rank."""

    index: int  # global buffer number g across the chained optimizer
    optimizer_index: int  # which DistributedOptimizer of the chain
    gbuf_index: int  # index in that optimizer's ``buffers``
    model_chunk: int
    param_dtype: str
    grad_dtype: str
    is_expert: bool
    mp: str  # model-parallel tag used in keys: tp<t>.pp<p> or tp<t>.ep<e>.pp<p>
    dp_size: int
    dp_rank: int
    replica_id: int  # distributed optimizer instance id; only instance 0 is the main replica
    buckets: tuple[BucketLayout, ...]

    def slice_numel(self, bucket: BucketLayout) -> int:
        """S: each DP rank's share of the padded bucket."""
        return bucket.padded_numel // self.dp_size

    def owned_range(
        self, bucket: BucketLayout, param: ParamLayout
    ) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """((lo, hi) in this rank's bucket slice, (lo, hi) in the flattened param), or None if not owned."""
        s = self.slice_numel(bucket)
        r0 = self.dp_rank * s
        p0, p1 = param.start - bucket.start, param.end - bucket.start
        lo, hi = max(p0, r0), min(p1, r0 + s)
        if hi <= lo:
            return None
        return (lo - r0, hi - r0), (lo - p0, hi - p0)


class MegatronLayout(msgspec.Struct, frozen=True):
    """Static buffer/bucket/param facts of one rank; JSON round-trips through :meth:`to_json`."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    buffers: tuple[BufferLayout, ...]
    megatron_core_version: str = ""
    model_prefix: str = MODEL_PREFIX
    optim_prefix: str = OPTIM_PREFIX
    version: int = MEGATRON_LAYOUT_VERSION

    def bucket_key(self, buffer: BufferLayout, bucket: BucketLayout, state: str) -> str:
        """The stored array of one state of one bucket (:func:`ckptd.writer.format.bucket_key`)."""
        return bucket_key(buffer.mp, buffer.index, bucket.index, state, self.optim_prefix)

    def bucket_prefix(self, buffer: BufferLayout, bucket: BucketLayout) -> str:
        """``optim/<mp>/buf<g>/bucket<b>/``: every state of the bucket is stored under it."""
        return bucket_prefix(buffer.mp, buffer.index, bucket.index, self.optim_prefix)

    def model_key(self, sharded_key: str) -> str:
        return _model_key(sharded_key, self.model_prefix)

    def buckets(self) -> Iterator[tuple[BufferLayout, BucketLayout]]:
        for buf in self.buffers:
            for bucket in buf.buckets:
                yield buf, bucket

    def with_params(self, change: Callable[[ParamLayout], ParamLayout]) -> MegatronLayout:
        """This layout with every param replaced by ``change(param)`` (buffers and buckets as they are)."""
        buffers = tuple(
            msgspec.structs.replace(buf, buckets=tuple(
                msgspec.structs.replace(bucket, params=tuple(change(p) for p in bucket.params))
                for bucket in buf.buckets))
            for buf in self.buffers
        )
        return msgspec.structs.replace(self, buffers=buffers)

    def to_json(self) -> str:
        return encode_layout(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> MegatronLayout:
        return decode_layout(text)


class _Versioned(msgspec.Struct):
    version: object = None


def encode_layout(layout: MegatronLayout) -> str:
    """Compact JSON with sorted keys: the sidecar's bytes (and so its content address) are stable."""
    return msgspec.json.encode(layout, order="sorted").decode()


def decode_layout(text: str | bytes) -> MegatronLayout:
    """Parse a layout sidecar.

    Raises :class:`InvalidRequestError` for a layout of another version and
    :class:`CorruptCheckpointError` for text that is not a layout.
    """
    try:
        head = msgspec.json.decode(text, type=_Versioned)
    except msgspec.DecodeError as exc:
        raise CorruptCheckpointError(f"unreadable Megatron layout: {exc}") from exc
    if head.version != MEGATRON_LAYOUT_VERSION or isinstance(head.version, bool):
        raise InvalidRequestError(f"unsupported Megatron layout version {head.version!r}")
    try:
        return msgspec.json.decode(text, type=MegatronLayout)
    except msgspec.DecodeError as exc:
        raise CorruptCheckpointError(f"malformed Megatron layout: {exc}") from exc
