"""Registered save plans: a rank's shard metas and slot layout, validated once, named by id in later saves.

A rank whose state keeps its structure (Megatron: every save after the first) registers the plan once
(:class:`~ckptd.client.protocol.RegisterPlan`); each save then leases one contiguous span and sends only
the plan's id. :meth:`PlanRegistry.expand` turns such a save back into what the writer knows: the plan's
shard metas, and a per-shard lease over the span. Nothing per shard is checked again on a save — that is
the point — so :meth:`PlanRegistry.register` checks everything a per-save validation would.

What one request may ask is bounded before it is accepted (a typed :class:`InvalidRequestError` says
which bound): its shard metas (:data:`MAX_SHARDS`), the chunks the daemon would write for it
(:data:`MAX_CHUNKS`; at most :data:`MAX_SMALL_BLOCKS` blocks under :data:`MIN_BLOCK_BYTES` to a shard) and
the work of planning its chunk grids (:data:`MAX_GRID_TRIALS`); registered plans are held within a byte
budget per connection and per daemon (the oldest go first, as beyond :data:`MAX_PLANS`: their clients
register them again); a daemon starts at most :data:`MAX_STEPS_IN_FLIGHT` steps that have not ended.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from ckptd.client.attempts import valid_token
from ckptd.client.protocol import PrepareStep, RegisterPlan, ReplicaMeta, SaveRequest, ShardMeta, encode_objects
from ckptd.daemon.arena import Lease
from ckptd.daemon.replicas import check_replica_metas
from ckptd.writer.errors import InvalidRequestError, LeaseError, PlanUnknownError, ProtocolError, ShardLayoutError
from ckptd.writer.format import DEFAULT_CHUNK_BYTES, check_region, itemsize, validate_key
from ckptd.writer.grid import plan_chunks_within

MAX_PLANS = 256  # plans kept (oldest dropped first); a dropped one is registered again by its client
# Shard (and replica) metas, and slots, in one save or plan: 10x what a rank of 10,000 tensors sends; a
# 100,000-shard plan holds ~80 MiB in the daemon and takes ~0.5 s of its loop to check
MAX_SHARDS = 100_000
# A shard spanning more than MAX_SMALL_BLOCKS blocks of its grid (chunk_shape) must have blocks of at least
# MIN_BLOCK_BYTES: the clients' shards are one block each (chunk_shape defaults to the shard's shape;
# Megatron's blocks are its shards), and a small grid chosen for another reader is fine, so only a grid of
# tiny blocks by the thousand (one element: a file per element) is refused
MIN_BLOCK_BYTES = 64 << 10
MAX_SMALL_BLOCKS = 4096
MAX_CHUNKS = 1 << 20  # chunks one save (or plan) writes: each is a file or object and a manifest record
# Divisor trials planning one request's chunk grids may take (~50 ms): blocks with large extents of few
# divisors are costly (a prime extent n: ~sqrt(n) trials); real ones take a handful each
MAX_GRID_TRIALS = 1 << 21
# Steps one daemon has started and not ended (each waits for its ranks, then writes and commits): a trainer
# has a few in flight (the arena fills first: each holds its staged bytes); one announcing steps it never saves
# (``PrepareStep``) started a job, a timeout task and a journal rewrite each, without end
MAX_STEPS_IN_FLIGHT = 256
# Bytes (estimated, :func:`plan_cost`) the registered plans of one connection, and of all, may hold: a
# node of 8 ranks of 30,000 shards each needs ~200 MiB; beyond either, the oldest plans go first
PLAN_BYTES_PER_CONNECTION = 128 << 20
PLAN_BYTES = 512 << 20


@dataclass(frozen=True)
class SavePlan:
    """A validated plan: its shard metas (``slot`` = index into offsets/sizes) and the span they tile."""

    plan_id: int
    shards: list[ShardMeta]
    offsets: list[int]
    sizes: list[int]
    span: int
    replicas: list[ReplicaMeta]  # the rank's non-main replica regions (replicas.py), sent once with the plan
    rank: int  # the rank that registered it, for the error message
    owner: int  # the connection that registered it: its id names it on that connection only
    cost: int = 0  # the bytes it holds, estimated (plan_cost)


def validate_plan(msg: RegisterPlan, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Everything the daemon checks of a save's shards, once: keys, dtypes, chunk grids, regions given
    once, slots that fit their shard and lie inside the span without overlapping."""
    _check_count(len(msg.shards) + len(msg.replicas), "shard and replica metas", "the plan")
    _check_count(len(msg.offsets), "slots", "the plan")
    n = len(msg.offsets)
    if len(msg.sizes) != n or msg.span < 0:
        raise LeaseError(f"plan: {n} slot offsets, {len(msg.sizes)} sizes, span {msg.span}")
    order = sorted(range(n), key=msg.offsets.__getitem__)
    end = 0
    for i in order:
        lo, size = msg.offsets[i], msg.sizes[i]
        if lo < end or size < 0 or lo + size > msg.span:
            raise LeaseError(f"plan: slot {i} [{lo}, {lo + size}) overlaps another or leaves the {msg.span}-byte span")
        end = lo + size
    check_shards(msg.shards, msg.sizes, "the plan", chunk_bytes)
    check_replica_metas(msg.replicas)


def check_placement(req: SaveRequest | PrepareStep) -> None:
    """The request's rank, node and attempt describe a possible placement."""
    if not (0 <= req.rank < req.world_size and 0 <= req.node < req.num_nodes):
        raise InvalidRequestError(
            f"rank {req.rank}/world {req.world_size}, node {req.node}/{req.num_nodes} is not a valid placement"
        )
    local, world = req.local_world_size, req.world_size
    if not 1 <= local <= world or (req.num_nodes == 1 and local != world):
        raise InvalidRequestError(f"local_world_size {local} of world {world} on {req.num_nodes} node(s): outside "
                                  "[1, world], or not all of it on one node (every rank is local)")
    if not valid_token(req.attempt):
        raise InvalidRequestError(f"attempt {req.attempt[:120]!r} is not an attempt token (client/attempts.py)")


def check_save(req: SaveRequest, sizes: Sequence[int], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """A save's shard and replica metas against its lease's slots (:func:`check_shards`), and its plain data."""
    _check_count(len(req.shards) + len(req.replicas), "shard and replica metas", f"the save of step {req.step}")
    check_shards(req.shards, sizes, f"lease {req.lease_id}", chunk_bytes)
    check_replica_metas(req.replicas)
    check_objects(req)


def check_objects(req: SaveRequest) -> None:
    """The save's non-tensor state is plain data, as the client checks it (it goes into the part manifest):
    anything else would fail the whole node's step when the part is written."""
    who = f"save of step {req.step}, rank {req.rank}"
    try:
        encode_objects(req.objects)
    except ProtocolError as exc:
        raise InvalidRequestError(f"{who}: {exc}") from None
    except RecursionError:
        raise InvalidRequestError(f"{who}: non-tensor state nested too deeply") from None


def _check_count(n: int, what: str, owner: str) -> None:
    if n > MAX_SHARDS:
        raise InvalidRequestError(f"{owner} has {n} {what}, more than the {MAX_SHARDS} one request may have")


def check_shards(
    shards: Sequence[ShardMeta], sizes: Sequence[int], owner: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> None:
    """A save's shard metas against the slots they name (of a plan or a lease, ``owner`` in errors): valid
    keys and chunk grids, regions inside their arrays and given once, each slot used once and big enough;
    and no more chunks to write (in grids of ``chunk_bytes``), nor planning work, than a request may ask."""
    used: set[int] = set()
    seen: set[tuple[str, tuple[int, ...]]] = set()
    grids: dict[tuple[int, ...], tuple[int, ...]] = {}  # by (*block shape, item size)
    trials = chunks = 0
    for meta in shards:
        validate_key(meta.key)
        if not 0 <= meta.slot < len(sizes) or meta.slot in used:
            raise LeaseError(f"{meta.key}: slot {meta.slot} is not a free slot of {owner}")
        used.add(meta.slot)
        item = itemsize(meta.dtype)
        size = math.prod(meta.shape) * item
        if size > sizes[meta.slot]:
            raise LeaseError(f"{meta.key}: {size} bytes do not fit slot {meta.slot} of {sizes[meta.slot]} bytes")
        if any(c <= 0 for c in meta.chunk_shape) or len(meta.chunk_shape) != len(meta.global_shape):
            raise ShardLayoutError(f"{meta.key}: invalid chunk grid {meta.chunk_shape}")
        check_region(meta.key, meta.global_shape, meta.global_offset, meta.shape, meta.chunk_shape)
        where = (meta.key, tuple(meta.global_offset))
        if where in seen:
            raise ShardLayoutError(f"{meta.key}: region at {meta.global_offset} given twice")
        seen.add(where)
        block, n = math.prod(meta.chunk_shape) * item, _cells(meta.global_offset, meta.shape, meta.chunk_shape)
        if block < MIN_BLOCK_BYTES and n > MAX_SMALL_BLOCKS:
            raise ShardLayoutError(
                f"{meta.key}: its region {meta.shape} spans {n} blocks of chunk_shape {meta.chunk_shape}, {block} "
                f"bytes each: a shard may span over {MAX_SMALL_BLOCKS} blocks only if each holds at least "
                f"{MIN_BLOCK_BYTES >> 10} KiB (a shard that is one block, the default, may be any size)"
            )
        key = (*meta.chunk_shape, item)
        grid = grids.get(key)
        if grid is None:  # planned once per block shape in a request, within the request's budget of trials
            try:
                grid, spent = plan_chunks_within(meta.chunk_shape, item, chunk_bytes, MAX_GRID_TRIALS - trials)
            except ShardLayoutError as exc:
                raise ShardLayoutError(f"{meta.key}: {exc} (one request may take {MAX_GRID_TRIALS})") from None
            grids[key] = grid
            trials += spent
        chunks += n if block <= chunk_bytes else _cells(meta.global_offset, meta.shape, grid)  # (unsplit: a block)
        if chunks > MAX_CHUNKS:
            raise InvalidRequestError(
                f"{meta.key}: {owner}'s shards up to this one would be written as {chunks} chunks (in grids of "
                f"--chunk-bytes {chunk_bytes}), more than the {MAX_CHUNKS} one request may write"
            )


def check_steps_in_flight(pending: Sequence[int], step: int) -> None:
    """Refuse to start ``step`` when :data:`MAX_STEPS_IN_FLIGHT` steps (``pending``) are in flight."""
    if len(pending) >= MAX_STEPS_IN_FLIGHT:
        raise InvalidRequestError(
            f"step {step}: {len(pending)} steps are already in flight on this node (steps {min(pending)} to "
            f"{max(pending)}), the most one daemon starts: each ends once its ranks saved it, or fails after "
            "--part-timeout"
        )


def _cells(offset: Sequence[int], shape: Sequence[int], grid: Sequence[int]) -> int:
    """Cells of ``grid`` an aligned region covers (none for an empty region)."""
    n = 1
    for o, m, g in zip(offset, shape, grid, strict=True):
        n *= (o + m + g - 1) // g - o // g
    return n


def plan_cost(msg: RegisterPlan) -> int:
    """About the bytes the daemon holds for a registered plan (measured: ~820 for a 3-D shard with a key of
    60 characters and its slot)."""
    metas: list[ShardMeta | ReplicaMeta] = [*msg.shards, *msg.replicas]
    return 256 + sum(256 + len(m.key) + len(m.dtype) + 160 * len(m.global_shape) for m in metas) + 72 * len(msg.offsets)


class PlanRegistry:
    """The daemon's registered plans, by id (bounded in number and bytes: the least recently used go first)."""

    def __init__(
        self, max_plans: int = MAX_PLANS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        connection_bytes: int = PLAN_BYTES_PER_CONNECTION, total_bytes: int = PLAN_BYTES,
    ) -> None:
        self._plans: OrderedDict[int, SavePlan] = OrderedDict()
        self._next_id = 1
        self._max = max_plans
        self._chunk_bytes = chunk_bytes
        self._connection_bytes = min(connection_bytes, total_bytes)
        self._total_bytes = total_bytes
        self._held: dict[int, int] = {}  # bytes of each connection's plans (plan_cost)

    def register(self, msg: RegisterPlan, owner: int) -> int:
        """Validate ``msg`` and keep it for connection ``owner``; returns its id.

        Clients register their plans once per connection, so an id means something only on the connection
        that registered it; a client that kept an id from an earlier connection, or an earlier daemon whose
        ids the new one hands out again, gets :class:`PlanUnknownError` and registers again. To keep the
        connection's plans, and all, within their byte budgets the oldest (the connection's own first) are
        dropped the same way; a plan over a connection's whole budget is refused.
        """
        _check_count(len(msg.shards) + len(msg.replicas), "shard and replica metas", "the plan")
        cost = plan_cost(msg)
        if cost > self._connection_bytes:
            raise InvalidRequestError(
                f"a plan of {len(msg.shards)} shards would hold ~{cost >> 20} MiB in the daemon, more than the "
                f"{self._connection_bytes >> 20} MiB a connection's plans may hold"
            )
        validate_plan(msg, self._chunk_bytes)
        plan = SavePlan(
            self._next_id, list(msg.shards), list(msg.offsets), list(msg.sizes), msg.span, list(msg.replicas),
            msg.rank, owner, cost,
        )
        self._next_id += 1
        self._plans[plan.plan_id] = plan
        self._held[owner] = self._held.get(owner, 0) + cost
        while self._held[owner] > self._connection_bytes:  # (never the new one: it fits the budget alone)
            self._drop(next(pid for pid, p in self._plans.items() if p.owner == owner))
        while len(self._plans) > self._max or sum(self._held.values()) > self._total_bytes:
            self._drop(next(iter(self._plans)))
        return plan.plan_id

    def _drop(self, plan_id: int) -> None:
        plan = self._plans.pop(plan_id)
        self._held[plan.owner] -= plan.cost
        if not self._held[plan.owner]:
            del self._held[plan.owner]

    def forget(self, owner: int) -> None:
        """Drop the plans of connection ``owner`` (it closed: nobody can name them any more)."""
        for pid in [pid for pid, plan in self._plans.items() if plan.owner == owner]:
            self._drop(pid)

    def spans(self) -> dict[int, int]:
        """Each rank's largest registered span: what its next plan save will lease."""
        out: dict[int, int] = {}
        for plan in self._plans.values():
            out[plan.rank] = max(out.get(plan.rank, 0), plan.span)
        return out

    def get(self, plan_id: int) -> SavePlan:
        plan = self._plans.get(plan_id)
        if plan is None:
            raise PlanUnknownError(f"save plan {plan_id} is not registered with this daemon")
        self._plans.move_to_end(plan_id)
        return plan

    def expand(self, req: SaveRequest, lease: Lease) -> tuple[SaveRequest, Lease]:
        """A plan save as the writer sees it: the plan's metas and replicas, and a lease with one slot per shard.

        The returned lease is a view over ``lease``'s one span: it is not registered with the arena and
        frees nothing itself (its slots start released); the caller releases ``lease`` when the rank's
        save is written.
        """
        if req.shards:
            raise LeaseError(f"save of step {req.step} names plan {req.plan_id} and sends shards too")
        if req.replicas:
            raise InvalidRequestError(f"save of step {req.step} names plan {req.plan_id} and sends replicas too")
        plan = self.get(req.plan_id)
        if plan.owner != lease.owner:  # never another connection's (another rank's) layout
            who = f"rank {plan.rank}, not {req.rank}" if plan.rank != req.rank else "another connection"
            raise PlanUnknownError(
                f"save plan {plan.plan_id} was registered by {who}: an id holds on its own connection only"
            )
        if len(lease.sizes) != 1 or lease.sizes[0] < plan.span:
            raise LeaseError(
                f"plan {plan.plan_id} needs one slot of {plan.span} bytes; lease {lease.lease_id} has {lease.sizes[:4]}"
            )
        base = lease.offsets[0]
        view = Lease(-lease.lease_id, lease.owner, [base + o for o in plan.offsets], list(plan.sizes))
        view.released = [True] * len(view.offsets)
        return msgspec.structs.replace(req, shards=plan.shards, replicas=plan.replicas), view
