"""Read the merged (fully-reshardable) optimizer layout into any TP/PP/DP layout.

``ckptd merge`` (:mod:`ckptd.writer.merge`) stores each optimizer state per parameter in model space
(``step_N/merged/optimizer.state.<state>.<model key>``, the model's global shapes). A rank of any new
parallel layout rebuilds its contiguous slice of each of its padded buckets from there: for every param
that overlaps the slice, assemble the param's state from its model pieces (each piece is a region of a
merged array) and copy the overlapping elements. The result has the shape
:func:`~ckptd.client.megatron.optimizer.apply_optimizer_state` takes, so loading is the same code either
way. Each rank reads only the params its slices touch. Nothing here imports megatron.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ckptd.client.fastread import ChunkReader
from ckptd.client.gather import Strided, boxes, monotone
from ckptd.client.megatron.coverage import covered, missing_box
from ckptd.client.megatron.layout import view_of
from ckptd.client.state import torch_dtype
from ckptd.writer.errors import StateMismatchError
from ckptd.writer.format import MAIN_PARAM, ArrayRecord, CommitManifest, bucket_states, merged_array_name
from ckptd.writer.layout import BucketLayout, BufferLayout, MegatronLayout, ModelPiece, ParamLayout
from ckptd.writer.merge import merged_states
from ckptd.writer.root import CheckpointRoot


@dataclass
class SliceRead:
    """This rank's optimizer slices as planned (:func:`plan_merged_slices`, :func:`plan_dp_slices`): the
    reads to add to a :class:`~ckptd.client.fastread.ChunkReader` of ``manifest``, then :meth:`finish`
    once it ran."""

    manifest: CommitManifest  # the step's commit manifest, or its merge manifest: whose arrays are read
    slices: dict[str, torch.Tensor] = field(default_factory=dict)
    regions: list[tuple[str, torch.Tensor, tuple[int, ...]]] = field(default_factory=list)  # (array, dst, offset)
    gathers: list[tuple[str, torch.Tensor, Strided]] = field(default_factory=list)  # (1-D array, dst, elements)
    # one region of several 1-D arrays (every state of a saved bucket), each into the same view of its slice
    states: list[tuple[list[str], list[torch.Tensor], ViewSpec, Strided]] = field(default_factory=list)
    straddling: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (slice part, scratch part)

    def add_to(self, reader: ChunkReader) -> None:
        """Add every read to ``reader`` (of :attr:`manifest`); it may hold other reads too."""
        for key, dst, offset in self.regions:
            reader.add(key, dst, offset)
        for key, dst, region in self.gathers:
            reader.add_gather(key, dst, region)
        for keys, outs, spec, region in self.states:
            reader.add_gathers(keys, outs, spec, region)

    async def read(self, root: CheckpointRoot) -> dict[str, torch.Tensor]:
        """Read through a reader of its own: the filled slices."""
        reader = ChunkReader(root, self.manifest)
        self.add_to(reader)
        await reader.run()
        return self.finish()

    def finish(self) -> dict[str, torch.Tensor]:
        """After the reads ran: copy each straddling param's part into its slice; the filled slices."""
        for dst, src in self.straddling:
            dst.copy_(src)
        return self.slices


async def merged_optimizer_slices(
    root: CheckpointRoot,
    step: int,
    manifest: CommitManifest,
    layout: MegatronLayout,
    dest: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`plan_merged_slices`, read: the filled slices."""
    return await plan_merged_slices(step, manifest, layout, dest).read(root)


def plan_merged_slices(
    step: int,
    manifest: CommitManifest,
    layout: MegatronLayout,
    dest: Mapping[str, torch.Tensor] | None = None, cut: Collection[ParamLayout] = (),
) -> SliceRead:
    """Plan this rank's ``{optim/<mp>/buf<g>/bucket<b>/<state>: 1-D slice}`` rebuilt from the merged layout;
    every check runs here, before anything is read or written.

    ``manifest`` is the step's merge manifest (:meth:`ckptd.writer.root.CheckpointRoot.read_merged_manifest`).
    Every model piece of every param the rank's slices touch is one region of a merged array, read through
    one :class:`~ckptd.client.fastread.ChunkReader` for the whole load (raw chunks straight into place,
    crc32c checked, bounded concurrency) straight into the slice; of a param that straddles a slice
    boundary only the part inside is read (:func:`_places`). ``dest``, ``cut`` as in :func:`plan_dp_slices`.
    """
    if manifest.step != step:
        raise StateMismatchError(f"the merge manifest is of step {manifest.step}, not of step {step}")
    arrays = {rec.name: rec for rec in manifest.arrays}
    states = merged_states(manifest)
    planned = SliceRead(manifest)
    for buf, bucket in layout.buckets():
        s = buf.slice_numel(bucket)
        lo, hi = buf.dp_rank * s, (buf.dp_rank + 1) * s
        touched = [covered(p, cut) for p in bucket.params if p.start - bucket.start < hi and p.end - bucket.start > lo]
        # where each param's pieces go, worked out once for every state (a scrambled one: per state)
        meta = torch.empty(s, device="meta")
        where = [None if _scrambled(p, bucket.start, lo, hi) else
                 _shapes(_places(p, meta, bucket.start, lo, hi, planned)) for p in touched]
        for state, dtype in states.items():
            key = layout.bucket_key(buf, bucket, state)
            given = dest.get(key) if dest is not None else None
            out = given if given is not None else torch.zeros(s, dtype=torch_dtype(dtype))
            for p, shapes in zip(touched, where, strict=True):
                places = _places(p, out, bucket.start, lo, hi, planned) if shapes is None else _views(out, shapes)
                for piece, placed in zip(p.model_pieces, places, strict=True):
                    name = merged_array_name(state, piece.key)
                    _check_merged(arrays.get(name), piece, state, dtype)
                    for box, dst in placed:
                        offset = tuple(o + x for o, (x, _y) in zip(piece.global_offset, box, strict=True))
                        planned.regions.append((name, dst, offset))
            planned.slices[key] = out
    return planned


Box = tuple[tuple[int, int], ...]
Places = list[list[tuple[Box, torch.Tensor]]]  # per model piece: (box, destination view)
ViewSpec = tuple[tuple[int, ...], tuple[int, ...], int]  # a view of a slice: shape, strides, offset in it
Shapes = list[list[tuple[Box, ViewSpec]]]


def _spec(view: torch.Tensor) -> ViewSpec:
    """A view of a (meta) slice, as what makes the same view of any slice (:func:`_view`)."""
    return tuple(view.shape), view.stride(), int(view.storage_offset())


def _view(out: torch.Tensor, spec: ViewSpec) -> torch.Tensor:
    shape, stride, at = spec
    return out.as_strided(shape, stride, out.storage_offset() + at)


def _shapes(places: Places) -> Shapes:
    """:func:`_places` worked out on a meta tensor: each destination as a :data:`ViewSpec`."""
    return [[(box, _spec(d)) for box, d in piece] for piece in places]


def _views(out: torch.Tensor, shapes: Shapes) -> Places:
    """:func:`_shapes`' destinations as views of the slice ``out``."""
    return [[(box, _view(out, spec)) for box, spec in piece] for piece in shapes]


def _check_merged(rec: ArrayRecord | None, piece: ModelPiece, state: str, dtype: str) -> None:
    """The merged array of ``piece``'s ``state`` exists, has the model's global shape and the state's dtype,
    and holds the piece's region."""
    if rec is None or tuple(rec.shape) != piece.global_shape:
        raise StateMismatchError(
            f"{piece.key}: the merged checkpoint has {'no' if rec is None else tuple(rec.shape)} state "
            f"'{state}' for it (the model wants global shape {piece.global_shape})"
        )
    if rec.torch_dtype != dtype:
        raise StateMismatchError(f"{rec.name}: dtype {rec.torch_dtype}, the other '{state}' arrays {dtype}")
    region = piece.region()
    if len(region) != len(rec.shape) or any(r.start < 0 or r.stop > n for r, n in zip(region, rec.shape, strict=False)):
        raise StateMismatchError(f"{rec.name}: model piece at {piece.global_offset} lies outside {tuple(rec.shape)}")


# --- merge-free: straight from the stored DP bucket slices ------------------------------------------------
@dataclass(frozen=True)
class _SavedPiece:
    """A piece of a saved param in model space, and where that param's state sits in its stored bucket."""

    piece: ModelPiece
    param: ParamLayout
    prefix: str  # the saved bucket's key prefix (``optim/<mp>/buf<g>/bucket<b>/``)
    lo: int  # the param's range in the saved padded bucket
    hi: int


class _SavedIndex:
    """Model key -> the saved pieces of it (main replicas first: any copy of a replica is equal), looked up by
    their first axis. A deep model's stacked array (one row a layer) has a saved piece a layer: testing every
    piece of the key for each piece needed was quadratic (8.8 M overlap tests for a 700-layer model)."""

    def __init__(self, pieces: Iterable[_SavedPiece]) -> None:
        by_key: dict[str, list[_SavedPiece]] = {}
        for sp in pieces:
            by_key.setdefault(sp.piece.key, []).append(sp)
        self._pieces: dict[str, list[_SavedPiece]] = {}
        # key -> the pieces' first-axis starts (sorted), their positions in that order, the widest extent
        self._axis0: dict[str, tuple[list[int], list[int], int]] = {}
        for key, pieces in by_key.items():
            pieces.sort(key=lambda s: any(s.piece.replica_id))
            self._pieces[key] = pieces
            if all(sp.piece.global_offset for sp in pieces):
                order = sorted(range(len(pieces)), key=lambda i: pieces[i].piece.global_offset[0])
                starts = [pieces[i].piece.global_offset[0] for i in order]
                self._axis0[key] = (starts, order, max(sp.piece.stored_shape[0] for sp in pieces))

    @classmethod
    def of(cls, saved: Iterable[MegatronLayout]) -> _SavedIndex:
        """The index of every piece of every param the saved layouts' buckets hold."""
        return cls(
            _SavedPiece(piece, p, lay.bucket_prefix(buf, bucket), p.start - bucket.start, p.end - bucket.start)
            for lay in saved for buf, bucket in lay.buckets() for p in bucket.params for piece in p.model_pieces
        )

    def overlapping(self, piece: ModelPiece) -> list[tuple[_SavedPiece, Box]]:
        """The saved pieces whose region meets ``piece``'s, in the index's order, each with the meeting
        region (global coordinates)."""
        pieces = self._pieces.get(piece.key, [])
        axis0 = self._axis0.get(piece.key)
        if axis0 is None or not piece.global_offset:
            candidates: Iterable[_SavedPiece] = pieces
        else:  # only pieces starting in (lo - widest, hi) can meet [lo, hi) on the first axis
            starts, order, widest = axis0
            lo = piece.global_offset[0]
            hi = lo + piece.stored_shape[0]
            window = order[bisect.bisect_left(starts, lo - widest + 1) : bisect.bisect_left(starts, hi)]
            candidates = [pieces[i] for i in sorted(window)]
        found = []
        for sp in candidates:
            inter = _overlap(piece, sp.piece)
            if inter is not None:
                found.append((sp, inter))
        return found


def _block(view: torch.Tensor, piece: ModelPiece) -> torch.Tensor:
    for _ in range(piece.prepend_axis_num):
        view = view.unsqueeze(0)
    return view


def saved_states(commit: CommitManifest, saved: Sequence[MegatronLayout]) -> dict[str, str]:
    """``{state: stored torch dtype}`` of every state the saved layouts' buckets hold (``param`` first)."""
    arrays = {rec.name: rec for rec in commit.arrays}
    states: dict[str, str] = {}
    for lay in saved:
        for buf, bucket in lay.buckets():
            prefix = lay.bucket_prefix(buf, bucket)
            for state in bucket_states(list(arrays), prefix):
                states.setdefault(state, arrays[prefix + state].torch_dtype)
    if MAIN_PARAM not in states:
        raise StateMismatchError(f"step {commit.step} holds no optimizer bucket state of the saved layouts")
    return states


def plan_dp_slices(
    commit: CommitManifest,
    saved: Sequence[MegatronLayout],
    layout: MegatronLayout,
    dest: Mapping[str, torch.Tensor] | None = None, cut: Collection[ParamLayout] = (),
) -> SliceRead:
    """Plan this rank's ``{optim/<mp>/buf<g>/bucket<b>/<state>: 1-D slice}`` rebuilt from the stored DP
    layout; every check runs here, before anything is read or written.

    No merge needed: ``saved`` holds one layout sidecar per saved model-parallel rank, which says for every
    saved param where its state sits in the stored padded buckets and where its pieces sit in model space.
    Each of this rank's params is assembled from the saved params that cover its model pieces (another TP
    splits a param differently; another PP, bucket size or DP moves it to another bucket): each overlap is
    a strided region of a saved bucket (a TP half of a row-parallel param takes every row's half), read by
    :meth:`~ckptd.client.fastread.ChunkReader.add_gather` straight into the param's place in this rank's
    slice of its own bucket. One reader for all states (and the model's tensors too, see
    :func:`~ckptd.client.megatron.load.load_checkpoint`): each stored chunk holding any needed element is
    read once, in the pieces holding a needed element where the manifest has each piece's checksum, else
    whole, and every piece read is checksummed; chunks holding none are skipped. Works for any TP/PP/DP and bucket
    layout; the merged layout (:func:`merged_optimizer_slices`) gives the same result.

    ``dest`` (optional) holds the slices to fill, by key (:mod:`~ckptd.client.megatron.targets`: often the
    optimizer's own memory); only the params' ranges are written there (padding is left as it is). Keys
    it lacks get fresh zeroed tensors. Of a param that straddles this rank's slice boundary (DP > 1) only
    the part inside is read, straight into place (:func:`_places`): a rank of a large DP group reads and
    holds its share of a large embedding, not all of it. ``cut``: params whose pieces were cut to a
    checkpoint's vocabulary rows (:mod:`~ckptd.client.megatron.vocab`): only their pieces are read.
    """
    arrays = {rec.name: rec for rec in commit.arrays}
    index = _SavedIndex.of(saved)
    states = saved_states(commit, saved)

    # 1. which saved params this rank needs, for which of its param pieces
    plans: list[tuple[BufferLayout, BucketLayout, list[tuple[ParamLayout, list[_Source]]]]] = []
    wanted: set[str] = set()  # the saved buckets read
    for buf, bucket in layout.buckets():
        s = buf.slice_numel(bucket)
        lo, hi = buf.dp_rank * s, (buf.dp_rank + 1) * s
        touched = []
        for p in bucket.params:
            if not (p.start - bucket.start < hi and p.end - bucket.start > lo):
                continue
            sources = []
            for piece in covered(p, cut).model_pieces:
                found = index.overlapping(piece)
                if not found:
                    raise StateMismatchError(
                        f"{p.name}: no saved optimizer state covers model piece {piece.key} at {piece.global_offset}"
                    )
                for sp, inter in _cover(piece, found):
                    sources.append((piece, sp, inter))
                    wanted.add(sp.prefix)
            touched.append((p, sources))
        plans.append((buf, bucket, touched))
    for prefix in sorted(wanted):
        for state in states:
            if prefix + state not in arrays:
                raise StateMismatchError(f"{prefix + state}: not in checkpoint step {commit.step}")

    slices: dict[str, torch.Tensor] = {}
    for buf, bucket, _touched in plans:
        for state, dtype in states.items():
            key = layout.bucket_key(buf, bucket, state)
            given = dest.get(key) if dest is not None else None
            slices[key] = given if given is not None else torch.zeros(buf.slice_numel(bucket), dtype=torch_dtype(dtype))

    # 2. every state of every param at once: each stored chunk that holds any element this rank needs is read
    # once (only its pieces holding one, where they have checksums of their own) and checksummed, and the
    # needed elements go straight into the param's place in this rank's slice (a TP half of a row-parallel
    # param: every row's half, a strided region); nothing else is allocated
    # The reads are the same for every state but for the arrays' names and the slices they land in: worked
    # out once, in integers (:func:`_param_read_specs`), and added for all states at once
    # (:meth:`~ckptd.client.fastread.ChunkReader.add_gathers`).
    planned = SliceRead(commit, slices)
    for buf, bucket, touched in plans:
        s = buf.slice_numel(bucket)
        lo, hi = buf.dp_rank * s, (buf.dp_rank + 1) * s
        meta = torch.empty(s, device="meta")
        reads: list[tuple[str, ViewSpec, Strided]] = []
        for p, sources in touched:
            if _scrambled(p, bucket.start, lo, hi):  # a scratch copy per state (no Megatron piece)
                for state in states:
                    out = slices[layout.bucket_key(buf, bucket, state)]
                    for prefix, dst, src in _param_reads(p, sources, out, bucket.start, lo, hi, planned):
                        planned.gathers.append((prefix + state, dst, src))
                continue
            reads += _param_read_specs(p, sources, meta, bucket.start, lo, hi, planned)
        outs = [slices[layout.bucket_key(buf, bucket, state)] for state in states]
        planned.states += [([prefix + state for state in states], outs, spec, src) for prefix, spec, src in reads]
    return planned


_Source = tuple[ModelPiece, _SavedPiece, Box]  # a piece of a live param, a saved piece covering part of it, and
# where the two meet (global coordinates)


def _param_reads(
    p: ParamLayout, sources: list[_Source], out: torch.Tensor, bucket_start: int, lo: int, hi: int, planned: SliceRead,
) -> Iterator[tuple[str, torch.Tensor, Strided]]:
    """``p``'s part of the slice ``out``, as reads from the saved pieces that cover it: (saved bucket's key
    prefix, destination view of ``out``, elements of that bucket)."""
    places = dict(zip(map(id, p.model_pieces), _places(p, out, bucket_start, lo, hi, planned), strict=True))
    for piece, sp, inter in sources:
        for box, dst in places[id(piece)]:
            part = _intersect(box, piece.global_offset, inter)  # what sp holds of this part
            if part is None:
                continue
            yield sp.prefix, dst[_box_sel(part, piece.global_offset, box)], _saved_elements(sp, part)


def _param_read_specs(
    p: ParamLayout, sources: list[_Source], meta: torch.Tensor, bucket_start: int, lo: int, hi: int, planned: SliceRead,
) -> list[tuple[str, ViewSpec, Strided]]:
    """:func:`_param_reads` of the meta slice ``meta``, each destination as the :data:`ViewSpec` that makes it
    of any slice, in integers (a deep model has thousands of params); torch's view arithmetic only places a
    param that the slice's edge cuts (:func:`_places`). The test checks the two agree."""
    a, b = p.start - bucket_start, p.end - bucket_start
    if lo <= a and b <= hi:  # wholly inside the slice: each piece's view of the param, placed at ``a - lo``
        places = {id(piece): [(tuple((0, n) for n in piece.stored_shape),
                               (piece.stored_shape, _prepended_strides(piece), a - lo + piece.view_offset))]
                  for piece in p.model_pieces}
    else:
        placed = _places(p, meta, bucket_start, lo, hi, planned)
        places = {id(piece): [(box, _spec(dst)) for box, dst in boxes]
                  for piece, boxes in zip(p.model_pieces, placed, strict=True)}
    out = []
    for piece, sp, inter in sources:
        for box, (_shape, stride, at) in places[id(piece)]:
            part = _intersect(box, piece.global_offset, inter)
            if part is None:
                continue
            sel = _box_sel(part, piece.global_offset, box)
            first = at + sum(x.start * t for x, t in zip(sel, stride, strict=True))
            spec = (tuple(x.stop - x.start for x in sel), stride, first)
            out.append((sp.prefix, spec, _saved_elements(sp, part)))
    return out


def _box_sel(part: Box, offset: Sequence[int], box: Box) -> tuple[slice, ...]:
    """``part`` (global coordinates) as a selection of ``box``'s destination (``box`` relative to ``offset``)."""
    return tuple(slice(x - o - b0, y - o - b0) for (x, y), o, (b0, _b1) in zip(part, offset, box, strict=True))


def _scrambled(p: ParamLayout, bucket_start: int, lo: int, hi: int) -> bool:
    """Whether ``p`` straddles the slice ``[lo, hi)`` with a piece view that does not keep the param's
    element order: :func:`_places` assembles it in a scratch tensor."""
    a, b = p.start - bucket_start, p.end - bucket_start
    if (max(a, lo), min(b, hi)) == (a, b):
        return False
    return not all(monotone(piece.view_shape, piece.view_stride) for piece in p.model_pieces)


def _places(
    p: ParamLayout, out: torch.Tensor, bucket_start: int, lo: int, hi: int, planned: SliceRead
) -> list[list[tuple[tuple[tuple[int, int], ...], torch.Tensor]]]:
    """Where each of ``p``'s model pieces goes in this rank's slice ``out`` (elements ``[lo, hi)`` of the
    padded bucket): per piece, ``(box, destination)`` pairs, the box in the piece's stored coordinates
    (``prepend_axis_num`` leading axes of extent 1) and the destination a view of ``out`` of its shape.

    A param wholly inside the slice is one box per piece. Of one that straddles the slice's edge only the
    part inside is placed: the piece's elements that land there, as boxes (a head of partial rows, the
    whole rows, a tail: :func:`~ckptd.client.gather.boxes`), each straight into ``out``. Should a piece's
    view not keep the param's element order (no Megatron piece does so), the whole param is assembled in a
    scratch tensor whose part is copied in after the read (:attr:`SliceRead.straddling`)."""
    a, b = p.start - bucket_start, p.end - bucket_start
    i, j = max(a, lo), min(b, hi)
    part = out[i - lo : j - lo]
    if (i, j) != (a, b):
        regions = [Strided(piece.view_offset, piece.view_shape, piece.view_stride) for piece in p.model_pieces]
        if all(monotone(r.sizes, r.strides) for r in regions):
            return [[_place(piece, part, sel, block.offset - (i - a)) for sel, block in boxes(r, i - a, j - a)]
                    for piece, r in zip(p.model_pieces, regions, strict=True)]
        value = torch.zeros(p.shape, dtype=out.dtype)  # (a cut param: zero where no piece is)
        planned.straddling.append((part, value.view(-1)[i - a : j - a]))
    else:
        value = part.view(p.shape)
    whole = [tuple((0, n) for n in piece.stored_shape) for piece in p.model_pieces]
    return [[(box, _block(view_of(piece, value), piece))] for piece, box in zip(p.model_pieces, whole, strict=True)]


def _place(
    piece: ModelPiece, part: torch.Tensor, sel: tuple[slice, ...], at: int
) -> tuple[tuple[tuple[int, int], ...], torch.Tensor]:
    """The box ``sel`` of the piece's view, whose first element lands at ``part[at]``: the box in stored
    coordinates and its destination, a view of ``part``."""
    shape = tuple(s.stop - s.start for s in sel)
    dst = part.as_strided(shape, piece.view_stride, part.storage_offset() + at)
    return ((0, 1),) * piece.prepend_axis_num + tuple((s.start, s.stop) for s in sel), _block(dst, piece)


def _intersect(
    box: tuple[tuple[int, int], ...], offset: Sequence[int], region: tuple[tuple[int, int], ...]
) -> tuple[tuple[int, int], ...] | None:
    """``box`` (relative to ``offset``) and ``region`` (global) intersected, in global coordinates."""
    out = []
    for (x, y), o, (rx, ry) in zip(box, offset, region, strict=True):
        lo, hi = max(x + o, rx), min(y + o, ry)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _saved_elements(sp: _SavedPiece, region: tuple[tuple[int, int], ...]) -> Strided:
    """Where the global ``region`` (inside the saved piece ``sp``) sits in the saved bucket: the piece's view
    of its param (``view_offset``, ``view_stride``; its ``prepend_axis_num`` leading axes of extent 1 add
    nothing) indexed by the region's start."""
    piece = sp.piece
    k = piece.prepend_axis_num
    starts = [x - o for (x, _y), o in zip(region, piece.global_offset, strict=True)]
    strides = _prepended_strides(piece)
    first = piece.view_offset + sum(a * t for a, t in zip(starts[k:], piece.view_stride, strict=True))
    return Strided(sp.lo + first, tuple(y - x for x, y in region), strides)


def _prepended_strides(piece: ModelPiece) -> tuple[int, ...]:
    """The strides of the piece's view with its ``prepend_axis_num`` leading axes, as ``unsqueeze(0)`` gives
    them (the stride of an axis of extent 1 locates nothing)."""
    strides = list(piece.view_stride)
    sizes = list(piece.view_shape)
    for _ in range(piece.prepend_axis_num):
        strides.insert(0, sizes[0] * strides[0] if sizes else 1)
        sizes.insert(0, 1)
    return tuple(strides)


def _overlap(a: ModelPiece, b: ModelPiece) -> tuple[tuple[int, int], ...] | None:
    """The intersection of two pieces' regions of one model array, or None."""
    if a.global_shape != b.global_shape or len(a.global_offset) != len(b.global_offset):
        return None
    whole = tuple((0, n) for n in a.stored_shape)
    return _intersect(whole, a.global_offset, tuple((r.start, r.stop) for r in b.region()))


def _cover(piece: ModelPiece, found: list[tuple[_SavedPiece, Box]]) -> list[tuple[_SavedPiece, Box]]:
    """Saved pieces (with where they meet ``piece``) that together cover ``piece`` (exactly: a region none
    holds is refused, named), one copy per region (replicas are skipped)."""
    chosen: list[tuple[_SavedPiece, Box]] = []
    seen: set[Box] = set()
    for sp, inter in found:
        if inter not in seen:
            seen.add(inter)
            chosen.append((sp, inter))
    gap = missing_box(tuple((o, o + n) for o, n in zip(piece.global_offset, piece.stored_shape, strict=True)), seen)
    if gap is not None:
        raise StateMismatchError(f"{piece.key}: no saved optimizer state holds its region {gap} ([lo, hi) per axis; "
                                 f"the model piece is at {piece.global_offset}, shape {piece.stored_shape})")
    return chosen
