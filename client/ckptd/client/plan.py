"""A save's per-tensor work, done once per run: the staged plan a rank registers with its daemon.

A :class:`StagePlan` is built from a rank's shards when their structure is new and reused while it holds:

- the shard metas and a slot layout inside one contiguous span (registered with the daemon once, then
  named by id: the daemon validates the metas once, the socket carries no per-shard data per save);
- a copy program: static sources (views of live memory whose address the caller's guard checks) merged
  into one byte copy per run contiguous in the source (the layout mirrors the source's gaps), sources looked
  up at each save (optimizer states, replaced by ``load_state_dict``; RNG states) and gaps to zero; on CPU,
  runs of 1-D sources into slots back to back (or apart by zeroed padding) are one ``torch.cat`` each
  (:mod:`ckptd.client.copyruns`);
- destination views into the mapped arena, prebuilt per span base the daemon grants (a few alternate): a
  save is a few concatenations, one batched ``_foreach_copy_`` and one stream sync.

What keeps a reused plan honest is the caller's guard (:mod:`ckptd.client.guard`: every static source's param
the same tensor with the same address, dtype, storage, sizes and strides; a param group's structure), checked
on every save; sources looked up at save time are checked against the plan before the lease, and a copy that
no longer fits its slot raises (:class:`StalePlanError`: the caller plans again).
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ckptd.client.copyruns import Dst as _Dst
from ckptd.client.copyruns import Gaps, cat_runs, numel, uncovered
from ckptd.client.guard import StateIndex, same_objects
from ckptd.client.protocol import PROTOCOL_VERSION, RegisterPlan, ReplicaMeta, ShardMeta, Welcome
from ckptd.client.state import Shard, dtype_name
from ckptd.writer.errors import CkptdError

ALIGN = 64  # slot alignment in the span: every dtype's views stay aligned, copies start on cache lines
MAX_BASES = 4  # span bases whose destination views are kept


class StalePlanError(CkptdError, RuntimeError):
    """A source looked up at save time no longer matches the plan (dtype, shape): plan again."""


class Checked(list[torch.Tensor]):
    """A plan's per-save tensors whose dtypes and shapes were compared with the plan's by the caller (the
    plain save's :class:`~ckptd.client.skeleton.Skeleton` of the dict its plan was made from)."""


class Fetch(NamedTuple):
    """A source looked up at each save: ``owner.state[key][name]`` (an optimizer's per-param state)."""

    owner: torch.optim.Optimizer
    key: torch.Tensor
    name: str


class Piece(NamedTuple):
    """One copy into a slot: ``lo`` bytes into it, from a static tensor, a lookup, or zeros (``nbytes``)."""

    lo: int
    src: torch.Tensor | None = None
    fetch: Fetch | None = None
    nbytes: int = 0  # zeros: this many bytes
    # a static ``src`` that is the memory of these lookups' tensors (re-homed optimizer states): each save
    # checks they still resolve to the tensors planned (address, dtype, element count), and copies ``src``,
    # which the plan holds weakly (the tensors' owner keeps it; :class:`WeakBytes`)
    held: tuple[Fetch, ...] = ()
    # a static ``src`` its owner may give other memory between saves (an optimizer's main param with memory
    # of its own, moved to the host and back): copied from as the object, never through a view of it
    live: bool = False


class WeakBytes:
    """A static source the plan must not keep alive: ``nbytes`` bytes from byte ``start`` of a tensor that
    its owner holds (a re-homed state's flat tensor, held by its views in the optimizer's state). Called at
    each save: the bytes, or :class:`StalePlanError` once the owner let the tensor go."""

    __slots__ = ("_ref", "nbytes", "start")
    dtype = torch.uint8

    def __init__(self, t: torch.Tensor, start: int, nbytes: int) -> None:
        self._ref = weakref.ref(t)
        self.start, self.nbytes = start, nbytes

    @property
    def shape(self) -> tuple[int]:
        return (self.nbytes,)

    def __call__(self) -> torch.Tensor:
        t = self._ref()
        if t is None:
            raise StalePlanError("a re-homed optimizer state's memory was let go since the save was planned")
        return bytes_of(t, self.start, self.nbytes)


_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def sync_streams(devices: Sequence[torch.device] = ()) -> None:
    """Wait for the copies queued on the current stream of each of ``devices`` and of the current device (a
    copy is queued on its source's device's stream: where a rank never called ``set_device``, not the
    current device's)."""
    current = torch.cuda.current_device()
    torch.cuda.current_stream(current).synchronize()
    for device in devices:
        if device.index is not None and device.index != current:
            torch.cuda.current_stream(device).synchronize()


class _Column(NamedTuple):
    """One state name looked up for several params of one optimizer: ``state[keys[i]][name]`` for each
    ``i`` in ``rows``, with the dtype and element count planned for each, or (held) the plan's own views."""

    name: str
    rows: list[int]
    dtypes: list[torch.dtype]
    numels: list[int]
    ptrs: list[int] | None = None  # held (checked at these addresses, not copied: a static source stages them)
    held: list[weakref.ref[torch.Tensor]] | None = None  # held: the plan's views, which the state must still be


class _Views(NamedTuple):
    """A span's destination views, in the copy program's order (:meth:`StagePlan._dst_views`)."""

    static: list[torch.Tensor]
    looked: list[torch.Tensor]
    zeros: list[torch.Tensor]
    static_cat: list[torch.Tensor]
    looked_cat: list[torch.Tensor]


# per optimizer: the params whose state is looked up, one column per state name, and where their states sit
_Groups = list[tuple[torch.optim.Optimizer, list[torch.Tensor], list[_Column], StateIndex]]


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """(storage address, byte offset) of a contiguous tensor, or None when it cannot join a run."""
    if not t.is_contiguous() or t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr(), int(t.storage_offset()) * t.element_size()


def bytes_of(t: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """A 1-D uint8 view of ``n`` bytes of ``t``'s storage from byte ``offset``."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), offset, (n,), (1,))


def shard_meta(shard: Shard, slot: int) -> ShardMeta:
    return ShardMeta(
        key=shard.key, dtype=dtype_name(shard.data.dtype), global_shape=list(shard.global_shape),
        global_offset=list(shard.global_offset), shape=list(shard.data.shape), chunk_shape=list(shard.grid),
        slot=slot,
    )


@dataclass
class StagePlan:
    """A rank's static save layout and copy program (see the module docstring).

    ``shards`` are staged from the pieces they describe (a ``stage_pieces()`` method, as
    :class:`~ckptd.client.megatron.optimizer.BucketSliceShard` has), else whole; ``dynamic`` shards
    keep their slot but get their tensor at each save (in order: :meth:`stage`'s ``dynamic`` argument),
    checked against the dtype and shape they had here.
    """

    metas: list[ShardMeta]
    offsets: list[int]
    sizes: list[int]
    span: int
    fingerprint: object
    _static: list[tuple[torch.Tensor | WeakBytes, _Dst]] = field(default_factory=list)
    _fetched: list[tuple[Fetch, _Dst, _Dst]] = field(default_factory=list)  # (lookup, source as planned, slot)
    _held: list[tuple[Fetch, weakref.ref[torch.Tensor]]] = field(default_factory=list)  # (lookup, tensor planned)
    _dynamic: list[tuple[_Dst, _Dst]] = field(default_factory=list)  # (source as planned, slot)
    _dynamic_types: tuple[list[torch.dtype], list[tuple[int, ...]]] = ([], [])  # theirs, set by compile_copies
    _zeros: list[_Dst] = field(default_factory=list)
    _views: OrderedDict[tuple[int, int], _Views] = field(default_factory=OrderedDict)
    _groups: _Groups | None = None
    # the copy program (compile_copies): runs of 1-D sources whose slots lie back to back (or apart by padding
    # that is zeroed anyway), each one torch.cat (static: the source tensors and zeros; looked up: indices into
    # this save's sources followed by _gap_zeros), and the rest by index
    _static_cat: list[tuple[list[Any], _Dst]] = field(default_factory=list)
    _static_rest: list[int] = field(default_factory=list)
    _rest_src: list[Any] = field(default_factory=list)  # the _static_rest sources, in order
    _weak: list[tuple[list[Any], int, WeakBytes]] = field(default_factory=list)  # where each save fills one in
    _looked_cat: list[tuple[list[int], _Dst]] = field(default_factory=list)
    _looked_rest: list[int] = field(default_factory=list)
    _gap_zeros: list[torch.Tensor] = field(default_factory=list)
    registered: tuple[Welcome, int] | None = None  # (the daemon's Welcome, plan id) it is registered under
    cuda: bool = False
    # the CUDA devices its sources are on (set by compile_copies): a D2H copy is queued on its source's device's
    # current stream, which is not the current device's where a rank never set it (sync_streams)
    devices: tuple[torch.device, ...] = ()
    static_bytes: int = 0  # what the static sources hold (set by compile_copies)
    replicas: list[ReplicaMeta] = field(default_factory=list)  # non-main replica regions, sent on registration

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    @property
    def has_static(self) -> bool:
        """Whether it copies static sources (what :meth:`stage_static` copies ahead of a save's checks)."""
        return bool(self._static)

    @property
    def copies(self) -> int:
        """Copies one save makes (merged runs and concatenated runs count once), zero fills included."""
        cats = len(self._static_cat) + len(self._looked_cat)
        return cats + len(self._static_rest) + len(self._looked_rest) + len(self._zeros)

    def compile_copies(self) -> None:
        """Group the copies: on CPU, runs of 1-D sources of the slot's dtype whose slots lie back to back
        (a bucket slice's per-param states, separate fp32 main params) become one ``torch.cat`` each
        (~0.1 µs a tensor against ~0.35 µs in ``_foreach_copy_``); the rest stay in the batched copy. On
        a GPU every copy is a D2H transfer into the pinned arena: one ``_foreach_copy_``."""
        static_dst = [d for _, d in self._static]
        self.static_bytes = sum(t.nbytes for t, _ in self._static)
        self._weak = []
        looked = [(src, d) for _, src, d in self._fetched] + self._dynamic
        self._dynamic_types = ([d.dtype for d, _ in self._dynamic], [d.shape for d, _ in self._dynamic])
        if self.cuda:
            planned = [t() if isinstance(t, WeakBytes) else t for t, _ in self._static]
            planned += [t for _, ref in self._held if (t := ref()) is not None]
            self.devices = tuple(dict.fromkeys(t.device for t in planned if t.is_cuda))
            self._static_rest, self._looked_rest = list(range(len(static_dst))), list(range(len(looked)))
            self._find_weak()
            return
        gaps = Gaps(self._zeros)
        static_src = [_Dst(0, t.dtype, tuple(t.shape)) for t, _ in self._static]
        runs, self._static_rest = cat_runs(static_src, static_dst, gaps)
        self._static_cat = [([self._static[x][0] if isinstance(x, int) else x for x in items], d) for items, d in runs]
        runs, self._looked_rest = cat_runs([src for src, _ in looked], [d for _, d in looked], gaps)
        for items, d in runs:
            idx = []
            for x in items:
                if not isinstance(x, int):  # a zeros tensor: indexed after this save's sources
                    self._gap_zeros.append(x)
                    x = len(looked) + len(self._gap_zeros) - 1
                idx.append(x)
            self._looked_cat.append((idx, d))
        # a concatenation writes the padding between its pieces, but not padding inside a byte run it copies (a
        # run of one buffer crosses the gaps between its params: those bytes come from the buffer), so those
        # zero fills stay, made after every copy
        free = set(uncovered(self._zeros, [d for _, d in self._static_cat] + [d for _, d in self._looked_cat]))
        outside = set(uncovered(self._zeros, static_dst))
        self._zeros = [z for z in self._zeros if z in free or z not in outside]
        self._find_weak()

    def released(self) -> bool | None:
        """Whether memory the plan holds weakly (re-homed states: :class:`WeakBytes`, their views) was let go by
        its owner since the plan was made; None when it holds none."""
        refs = [r for _, r in self._held] + [w._ref for w, _ in self._static if isinstance(w, WeakBytes)]
        return None if not refs else any(r() is None for r in refs)

    def _find_weak(self) -> None:
        """The source lists of the static copies, and where in them each save puts a weakly held source."""
        self._rest_src = [self._static[i][0] for i in self._static_rest]
        for srcs in [self._rest_src, *(srcs for srcs, _ in self._static_cat)]:
            self._weak += [(srcs, i, t) for i, t in enumerate(srcs) if isinstance(t, WeakBytes)]

    def register_message(self, rank: int) -> RegisterPlan:
        return RegisterPlan(
            v=PROTOCOL_VERSION, rank=rank, shards=self.metas, offsets=self.offsets, sizes=self.sizes, span=self.span,
            replicas=self.replicas,
        )

    def plan_id(self, welcome: Welcome | None) -> int:
        """The id the plan is registered under with the daemon that sent ``welcome``, else 0."""
        if self.registered is None or welcome is None or self.registered[0] is not welcome:
            return 0
        return self.registered[1]

    def sources(
        self, dynamic: Sequence[torch.Tensor], fetched: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """This save's looked-up sources (fetched, then ``dynamic``), checked against the plan; call it
        before leasing so a stale plan costs no staging space. ``fetched``: the fetched sources as the
        caller holds them from an earlier :meth:`fetch` (under a constant-structure promise): no lookup.
        ``dynamic`` as :class:`Checked`: compared with the plan's already."""
        out = list(fetched) if fetched is not None else self.fetch()
        if len(dynamic) != len(self._dynamic):
            raise StalePlanError(f"{len(dynamic)} per-save tensors given, the plan has {len(self._dynamic)}")
        dtypes, shapes = self._dynamic_types
        if not isinstance(dynamic, Checked) and (
            list(map(_DTYPE, dynamic)) != dtypes or list(map(_SHAPE, dynamic)) != shapes
        ):
            t, d = next((t, d) for t, (d, _) in zip(dynamic, self._dynamic, strict=True) if (t.dtype, t.shape) != d[1:])
            raise StalePlanError(f"a per-save tensor is {t.dtype}{tuple(t.shape)}, planned {d.dtype}{d.shape}")
        return out + list(dynamic)

    def fetch(self) -> list[torch.Tensor]:
        """The sources looked up at each save (optimizer states), checked against the plan.

        Per optimizer its params' state dicts (by position while ``state``'s keys stay as they were:
        :class:`~ckptd.client.guard.StateIndex`), then per state name one ``map`` over C getters (the
        tensor, its dtype, its element count: ~0.8-1 µs a source in a trained process). The element count,
        not the shape: a copy of the same count either moves the same elements or raises (broadcasting
        cannot fill a slot from fewer elements), and a changed param shape is the caller's guard's to
        catch. A held state (re-homed: a static source stages it) must still be the plan's own view at its
        address (cast or resized in place, the optimizer's step could not run on it)."""
        out: list[torch.Tensor] = []
        for owner, keys, columns, index in self._groups or ():
            dicts: list[Any] = index.lookup(owner.state, keys)
            for col in columns:
                try:
                    got = list(map(operator.itemgetter(col.name), map(dicts.__getitem__, col.rows)))
                    if col.held is not None:
                        held = list(map(operator.call, col.held))  # None where the plan's view is gone
                        ok = same_objects(got, held) and list(map(torch.Tensor.data_ptr, got)) == col.ptrs
                    else:
                        ok = list(map(_DTYPE, got)) == col.dtypes and list(map(torch.Tensor.numel, got)) == col.numels
                except (KeyError, TypeError, AttributeError):  # gone, its param has no state, not a tensor
                    ok = False
                if not ok:
                    raise StalePlanError(f"optimizer state {col.name!r} changed since the save was planned")
                if col.held is None:
                    out += got
        return out

    def _group_fetches(self) -> None:
        """Order ``_fetched`` by (optimizer, state name, param) and record the lookups in that order: one
        column of C-level lookups per (optimizer, state name) at each save (:meth:`sources`)."""
        owners: dict[int, tuple[torch.optim.Optimizer, dict[int, int], list[torch.Tensor]]] = {}
        cols: dict[tuple[int, str], list[tuple[Fetch, _Dst, _Dst]]] = {}
        held: dict[tuple[int, str], list[tuple[Fetch, weakref.ref[torch.Tensor]]]] = {}
        for f in itertools.chain((e[0] for e in self._fetched), (h[0] for h in self._held)):
            _, index, keys = owners.setdefault(id(f.owner), (f.owner, {}, []))
            if id(f.key) not in index:
                index[id(f.key)] = len(keys)
                keys.append(f.key)
        for e in self._fetched:
            cols.setdefault((id(e[0].owner), e[0].name), []).append(e)
        for h in self._held:
            held.setdefault((id(h[0].owner), h[0].name), []).append(h)
        groups: _Groups = []
        fetched: list[tuple[Fetch, _Dst, _Dst]] = []  # in the order sources() returns them
        for oid, (owner, index, keys) in owners.items():
            columns = []
            for (o, name), entries in cols.items():
                if o == oid:
                    columns.append(_Column(
                        name, [index[id(f.key)] for f, _, _ in entries], [d.dtype for _, d, _ in entries],
                        [numel(d.shape) for _, d, _ in entries],
                    ))
                    fetched += entries
            for (o, name), hs in held.items():
                if o == oid:
                    refs = [r for _, r in hs]
                    ts = [r() for r in refs]
                    if any(t is None for t in ts):
                        raise StalePlanError(f"optimizer state {name!r} changed while the save was planned")
                    rows = [index[id(f.key)] for f, _ in hs]
                    columns.append(_Column(name, rows, [], [], [t.data_ptr() for t in ts if t is not None], refs))
            groups.append((owner, keys, columns, StateIndex()))
        self._fetched = fetched
        self._groups = groups

    def _dst_views(self, arena: torch.Tensor, base: int) -> _Views:
        key = (arena.data_ptr(), base)
        views = self._views.get(key)
        if views is None:
            def view(d: _Dst) -> torch.Tensor:
                n = d.dtype.itemsize * numel(d.shape)
                return arena[base + d.rel : base + d.rel + n].view(d.dtype).view(d.shape)

            looked = [d for _, _, d in self._fetched] + [d for _, d in self._dynamic]
            views = _Views(
                [view(self._static[i][1]) for i in self._static_rest],
                [view(looked[i]) for i in self._looked_rest],
                [view(d) for d in self._zeros],
                [view(d) for _, d in self._static_cat],
                [view(d) for _, d in self._looked_cat],
            )
            self._views[key] = views
            while len(self._views) > MAX_BASES:
                self._views.popitem(last=False)
        return views

    def stage(self, arena: torch.Tensor, base: int, sources: list[torch.Tensor], static: bool = True) -> None:
        """Copy everything into the span at byte ``base`` of ``arena`` (uint8): batched, then one sync.
        ``static=False``: the static sources were copied already (:meth:`stage_static`, same span), and on a
        CPU the padding zeroed."""
        views = self._dst_views(arena, base)
        try:
            with torch.no_grad():  # sources may require grad (a plain save of params); torch.cat(out=) refuses those
                if static:
                    self._copy_static(views)
                self._copy_looked(views, sources)
        finally:  # on a failure too: a span given back must not receive a queued device copy afterwards
            if self.cuda:
                sync_streams(self.devices)
        # after the static copies landed (on a GPU, after the sync): a static run may cross a gap that is zeroed.
        # The zeroed gaps are padding, never a looked-up source's slot, so the looked-up copies cannot touch them
        if views.zeros and (static or self.cuda):
            torch._foreach_zero_(views.zeros)

    def stage_static(self, arena: torch.Tensor, base: int) -> None:
        """Copy the static sources (memory the plan holds) into the span at ``base``, ahead of a save's checks,
        and on a CPU zero the padding after them; on a GPU the copies are queued and not waited for (the
        :meth:`stage` that follows with ``static=False`` waits, then zeroes, and so must whoever gives the span
        up instead: :mod:`ckptd.client.early`)."""
        try:
            with torch.no_grad():
                views = self._dst_views(arena, base)
                self._copy_static(views)
                if views.zeros and not self.cuda:
                    torch._foreach_zero_(views.zeros)
        except BaseException:
            if self.cuda:
                sync_streams(self.devices)
            raise

    def _copy_static(self, views: _Views) -> None:
        """The static copies; a weakly held source is resolved for them and let go after, and a live source
        that no longer fits its slot (its owner gave it other memory) raises :class:`StalePlanError`."""
        try:
            for srcs, i, weak in self._weak:
                srcs[i] = weak()
            for (srcs, _), dst in zip(self._static_cat, views.static_cat, strict=True):
                torch.cat(srcs, out=dst)
            if views.static:
                torch._foreach_copy_(views.static, self._rest_src, non_blocking=self.cuda)
        except StalePlanError:
            raise
        except RuntimeError as exc:
            raise StalePlanError(f"a static source no longer fits its slot: {exc}") from exc
        finally:
            for srcs, i, weak in self._weak:
                srcs[i] = weak

    def _copy_looked(self, views: _Views, sources: list[torch.Tensor]) -> None:
        # the plan's device, not a walk over this save's sources: a looked-up source that moved to the GPU
        # since is copied blocking (non_blocking=False), which is correct, only slower
        looked_dst, looked_cat_dst = views.looked, views.looked_cat
        try:
            # the element counts were checked (sources()), so a concatenation never outgrows its run
            ext = sources + self._gap_zeros if self._gap_zeros else sources
            for (idx, _), dst in zip(self._looked_cat, looked_cat_dst, strict=True):
                torch.cat(list(map(ext.__getitem__, idx)), out=dst)
            if looked_dst:
                every = len(looked_dst) == len(sources)
                rest = sources if every else list(map(sources.__getitem__, self._looked_rest))
                torch._foreach_copy_(looked_dst, rest, non_blocking=self.cuda)
        except RuntimeError as exc:  # the planned element count in another shape: copy_ and cat refuse it
            raise StalePlanError(f"a looked-up source no longer fits its slot: {exc}") from exc
