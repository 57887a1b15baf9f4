"""The save plan's pure parts: layout and copy program (client), the plan cache, and the daemon's plan registry."""

from __future__ import annotations

import itertools
import logging
import math
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from ckptd.client import staging
from ckptd.client.plan import Fetch, Piece, StalePlanError
from ckptd.client.planbuild import build_stage_plan
from ckptd.client.protocol import PROTOCOL_VERSION, RegisterPlan, SaveRequest, decode_request, encode
from ckptd.client.reuse import PlanCache
from ckptd.client.staging import StagingArena
from ckptd.client.state import Shard
from ckptd.daemon.arena import Lease
from ckptd.daemon.plans import PlanRegistry, validate_plan
from ckptd.writer.errors import LeaseError, PlanUnknownError, ShardLayoutError


def _slot(arena: torch.Tensor, base: int, plan, i: int) -> torch.Tensor:
    m = plan.metas[i]
    dtype = getattr(torch, m.dtype)
    n = math.prod(m.shape) * dtype.itemsize
    lo = base + plan.offsets[m.slot]
    return arena[lo : lo + n].view(dtype).view(m.shape)


def test_views_of_one_buffer_stage_in_one_copy_and_land_in_their_slots() -> None:
    buf = torch.arange(1000, dtype=torch.float32)
    # out of order, with gaps between them, like params in a grad buffer
    ranges = [(500, 600), (0, 100), (130, 400)]
    shards = [Shard(f"p{i}", buf[lo:hi], (hi - lo,), (0,)) for i, (lo, hi) in enumerate(ranges)]
    plan = build_stage_plan(shards)
    assert plan.copies == 1  # one run: the layout mirrors the source's gaps
    arena = torch.zeros(plan.span + 8192, dtype=torch.uint8)
    for base in (0, 4096):
        plan.stage(arena, base, plan.sources([]))
        for i, s in enumerate(shards):
            assert torch.equal(_slot(arena, base, plan, i), s.data)
    buf.add_(1)  # the plan copies live memory: a later save sees the new values
    plan.stage(arena, 4096, plan.sources([]))
    assert torch.equal(_slot(arena, 4096, plan, 0), buf[500:600])
    # slots never overlap, and each fits its shard
    spans = sorted((plan.offsets[i], plan.offsets[i] + plan.sizes[i]) for i in range(len(shards)))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_non_contiguous_and_mixed_sources_are_copied_exactly() -> None:
    a = torch.randn(8, 6)
    b = torch.randn(5, dtype=torch.float64)
    c = torch.randint(0, 100, (7,), dtype=torch.int32)
    shards = [Shard("t", a.t(), (6, 8), (0, 0)), Shard("b", b, (5,), (0,)), Shard("c", c, (7,), (0,))]
    plan = build_stage_plan(shards)
    arena = torch.zeros(plan.span, dtype=torch.uint8)
    plan.stage(arena, 0, plan.sources([]))
    for i, s in enumerate(shards):
        assert torch.equal(_slot(arena, 0, plan, i), s.data)
        assert plan.offsets[i] % s.data.element_size() == 0


class _Sliced(Shard):
    """A shard assembled from pieces, like a bucket slice: a static run, a looked-up state, a gap."""

    pieces: list[Piece] = []

    def stage_pieces(self) -> list[Piece]:
        return self.pieces


def _sliced(opt: torch.optim.Optimizer, p: torch.nn.Parameter) -> tuple[_Sliced, _Sliced]:
    n = p.numel()
    main = _Sliced("main", torch.empty(n + 4), (n + 4,), (0,))
    object.__setattr__(main, "pieces", [Piece(0, src=p.detach().view(-1)), Piece(n * 4, nbytes=16)])
    state = _Sliced("exp_avg", torch.empty(n + 4), (n + 4,), (0,))
    object.__setattr__(state, "pieces", [Piece(0, fetch=Fetch(opt, p, "exp_avg")), Piece(n * 4, nbytes=16)])
    return main, state


def test_looked_up_sources_follow_the_optimizer_and_a_changed_one_is_refused() -> None:
    p = torch.nn.Parameter(torch.randn(10))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(10)
    opt.step()
    rng = torch.get_rng_state()
    main, state = _sliced(opt, p)
    plan = build_stage_plan([main, state], [Shard("rng", rng, tuple(rng.shape), (0,))])
    arena = torch.full((plan.span,), 7, dtype=torch.uint8)
    plan.stage(arena, 0, plan.sources([rng]))
    assert torch.equal(_slot(arena, 0, plan, 0)[:10], p.detach())
    assert torch.equal(_slot(arena, 0, plan, 0)[10:], torch.zeros(4))  # the gap is zeroed
    assert torch.equal(_slot(arena, 0, plan, 1)[:10], opt.state[p]["exp_avg"])
    assert torch.equal(_slot(arena, 0, plan, 2), rng)
    # load_state_dict replaces the state tensors: the next save reads the new ones
    opt.load_state_dict(opt.state_dict())
    opt.state[p]["exp_avg"].fill_(3.0)
    plan.stage(arena, 0, plan.sources([rng]))
    assert torch.equal(_slot(arena, 0, plan, 1)[:10], torch.full((10,), 3.0))
    # a state of another dtype, or a per-save tensor of another shape: refused before anything is copied
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].to(torch.bfloat16)
    with pytest.raises(StalePlanError):
        plan.sources([rng])
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].float()
    with pytest.raises(StalePlanError):
        plan.sources([rng[:-1]])
    # the planned element count in another shape: passes the lookup, refused by the copy (no bytes land)
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].view(2, 5)
    with pytest.raises(StalePlanError):
        plan.stage(arena, 0, plan.sources([rng]))
    opt.state[p]["exp_avg"] = "not a tensor"
    with pytest.raises(StalePlanError):
        plan.sources([rng])
    del opt.state[p]["exp_avg"]
    with pytest.raises(StalePlanError):
        plan.sources([rng])
    del opt.state[p]
    with pytest.raises(StalePlanError):
        plan.sources([rng])


def test_lookups_of_several_params_and_states_land_in_their_own_slots() -> None:
    # two optimizers, params with different state sets, pieces listed out of order: the copy program
    # groups lookups per (optimizer, state name); every state must still land at its own offset
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (3, 5, 4)]
    opts = [torch.optim.Adam(ps[:2]), torch.optim.Adam(ps[2:])]
    for p in ps:
        p.grad = torch.randn(p.shape)
    for o in opts:
        o.step()
    opts[0].state[ps[1]]["extra"] = torch.randn(5)  # a state only one param keeps
    wanted = [(1, "exp_avg_sq"), (0, "exp_avg"), (2, "exp_avg"), (1, "extra"), (1, "exp_avg"), (0, "exp_avg_sq")]
    pieces, lo = [], 0
    for i, name in wanted:
        pieces.append(Piece(lo, fetch=Fetch(opts[0] if i < 2 else opts[1], ps[i], name)))
        lo += ps[i].numel() * 4
    shard = _Sliced("s", torch.empty(lo // 4), (lo // 4,), (0,))
    object.__setattr__(shard, "pieces", pieces)
    plan = build_stage_plan([shard])
    arena = torch.zeros(plan.span, dtype=torch.uint8)
    plan.stage(arena, 0, plan.sources([]))
    got = _slot(arena, 0, plan, 0)
    at = 0
    for i, name in wanted:
        n = ps[i].numel()
        st = (opts[0] if i < 2 else opts[1]).state[ps[i]][name]
        assert torch.equal(got[at : at + n], st), (i, name)
        at += n


def test_states_and_separate_mains_across_padding_are_one_concatenation_each() -> None:
    # a bucket slice: per-param states (separate tensors) in the slot with zeroed padding between them
    # (Megatron pads each param to 64 elements), and separate main params (bf16 training keeps fp32 copies)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (3, 5, 4, 6)]
    opt = torch.optim.Adam(ps)
    for p in ps:
        p.grad = torch.randn(p.shape)
    opt.step()
    pad = 2
    n = pad + sum(p.numel() + pad for p in ps)
    shards = []
    for name in ("param", "exp_avg", "exp_avg_sq"):
        pieces, lo = [Piece(0, nbytes=pad * 4)], pad * 4  # leading padding too (a DP slice starting mid-bucket)
        for p in ps:
            pieces.append(Piece(lo, src=p.detach()) if name == "param" else Piece(lo, fetch=Fetch(opt, p, name)))
            lo += p.numel() * 4
            pieces.append(Piece(lo, nbytes=pad * 4))
            lo += pad * 4
        shard = _Sliced(name, torch.empty(n), (n,), (0,))
        object.__setattr__(shard, "pieces", pieces)
        shards.append(shard)
    plan = build_stage_plan(shards)
    # one concatenation per shard; the padding between slots of different shards is never crossed
    assert (len(plan._static_cat), len(plan._looked_cat), plan._static_rest, plan._looked_rest) == (1, 2, [], [])
    assert plan._zeros == [] and plan.copies == 3  # the runs write the padding they cross or end on
    arena = torch.full((plan.span,), 9, dtype=torch.uint8)

    def check() -> None:
        plan.stage(arena, 0, plan.sources([]))
        for i, name in enumerate(("param", "exp_avg", "exp_avg_sq")):
            want = [torch.zeros(pad)]
            want += [t for p in ps for t in (p.detach() if name == "param" else opt.state[p][name], torch.zeros(pad))]
            assert torch.equal(_slot(arena, 0, plan, i), torch.cat(want)), name
        lo, hi = plan.offsets[0] + plan.sizes[0], plan.offsets[1]
        assert bool((arena[lo:hi] == 9).all())  # bytes between slots untouched

    check()
    opt.load_state_dict(opt.state_dict())  # new state tensors: the next save reads them
    for p in ps:
        opt.state[p]["exp_avg"].add_(1.0)
    check()
    opt.state[ps[2]]["exp_avg_sq"] = opt.state[ps[2]]["exp_avg_sq"].view(2, 2)  # count kept, shape not
    with pytest.raises(StalePlanError):
        plan.stage(arena, 0, plan.sources([]))


def test_plan_cache_returns_a_plan_only_for_its_fingerprint() -> None:
    cache = PlanCache()
    plan = build_stage_plan([Shard("a", torch.zeros(3), (3,), (0,))], fingerprint=("f", 1))
    cache.put("opt", plan)
    assert cache.get("opt", ("f", 1)) is plan
    assert cache.get("opt", ("f", 2)) is None
    cache.drop("opt")
    assert cache.get("opt", ("f", 1)) is None


# --- daemon side ------------------------------------------------------------------------------------
def _register(shards: list[Shard]) -> RegisterPlan:
    return build_stage_plan(shards).register_message(0)


def test_registry_validates_once_and_expands_a_save_onto_its_span() -> None:
    shards = [Shard("a", torch.zeros(10), (20,), (0,), chunk_shape=(10,)),
              Shard("b", torch.zeros(3, 2), (3, 2), (0, 0))]
    msg = _register(shards)
    assert decode_request(encode(msg)[4:]) == msg  # round trip on the wire
    reg = PlanRegistry(max_plans=2)
    pid = reg.register(msg, owner=1)
    save = SaveRequest(v=PROTOCOL_VERSION, lease_id=5, step=1, rank=0, world_size=1, node=0, num_nodes=1,
                       local_world_size=1, shards=[], objects={}, plan_id=pid)
    span = Lease(5, 1, [8192], [msg.span])
    req, view = reg.expand(save, span)
    assert req.shards == msg.shards
    assert view.offsets == [8192 + o for o in msg.offsets] and view.sizes == msg.sizes
    assert all(view.released)  # the view frees nothing; the span is released whole
    with pytest.raises(LeaseError):
        reg.expand(save, Lease(6, 1, [0], [msg.span - 1]))  # a span too small
    with pytest.raises(LeaseError):
        reg.expand(msgspec.structs.replace(save, shards=msg.shards), span)  # plan and shards at once
    reg.register(msg, owner=1)
    reg.register(msg, owner=1)  # the oldest plan is dropped: its client registers it again
    with pytest.raises(PlanUnknownError):
        reg.get(pid)


def test_a_plan_id_names_the_plan_on_its_own_connection_only() -> None:
    msg = _register([Shard("a", torch.zeros(10), (10,), (0,))])
    reg = PlanRegistry()
    pid = reg.register(msg, owner=1)
    save = SaveRequest(v=PROTOCOL_VERSION, lease_id=5, step=1, rank=0, world_size=1, node=0, num_nodes=1,
                       local_world_size=1, shards=[], objects={}, plan_id=pid)
    with pytest.raises(PlanUnknownError, match="another connection"):  # same rank, a later connection
        reg.expand(save, Lease(5, 2, [0], [msg.span]))
    req, _ = reg.expand(save, Lease(5, 1, [0], [msg.span]))
    assert req.shards == msg.shards
    reg.forget(1)  # the connection closed
    with pytest.raises(PlanUnknownError, match="not registered"):
        reg.expand(save, Lease(5, 1, [0], [msg.span]))


def test_invalid_plans_are_refused_at_registration() -> None:
    good = _register([Shard("a", torch.zeros(10), (10,), (0,)), Shard("b", torch.zeros(4), (4,), (0,))])
    overlapping = msgspec.structs.replace(good, offsets=[0, 8])
    with pytest.raises(LeaseError, match="overlaps"):
        validate_plan(overlapping)
    small = msgspec.structs.replace(good, sizes=[40, 8])
    with pytest.raises(LeaseError, match="do not fit"):
        validate_plan(small)
    outside = msgspec.structs.replace(good, span=good.offsets[1] + 8)
    with pytest.raises(LeaseError):
        validate_plan(outside)
    pair = _register([Shard("a", torch.zeros(10), (10,), (0,)), Shard("c", torch.zeros(10), (10,), (0,))])
    twice = msgspec.structs.replace(pair, shards=[pair.shards[0], msgspec.structs.replace(pair.shards[0], slot=1)])
    with pytest.raises(ShardLayoutError, match="given twice"):
        validate_plan(twice)
    off_grid = msgspec.structs.replace(good, shards=[msgspec.structs.replace(good.shards[0], global_offset=[3])])
    with pytest.raises(ShardLayoutError):
        validate_plan(off_grid)


def test_static_copies_made_ahead_then_the_rest_stage_the_same_bytes_with_the_padding_zeroed() -> None:
    # two params in one buffer with 20 elements of padding between them that hold other bytes (a run crosses
    # it: one copy), one from another buffer right after them, then an optimizer state looked up at each save
    buf = torch.arange(1, 401, dtype=torch.float32)
    p = torch.nn.Parameter(torch.randn(6))
    opt = torch.optim.Adam([p])
    p.grad = torch.randn(6)
    opt.step()
    other = torch.arange(-50, 0, dtype=torch.float32)  # another buffer, its slot right after the run's
    param = _Sliced("param", torch.empty(350), (350,), (0,))
    object.__setattr__(param, "pieces", [Piece(0, src=buf[0:100]), Piece(400, nbytes=80),
                                         Piece(480, src=buf[120:300]), Piece(1200, src=other)])
    state = _Sliced("exp_avg", torch.empty(6), (6,), (0,))
    object.__setattr__(state, "pieces", [Piece(0, fetch=Fetch(opt, p, "exp_avg"))])
    plan = build_stage_plan([param, state])
    assert plan.has_static
    want_param = torch.cat([buf[0:100], torch.zeros(20), buf[120:300], other])
    whole = torch.full((plan.span,), 9, dtype=torch.uint8)
    plan.stage(whole, 0, plan.sources([]))
    assert torch.equal(_slot(whole, 0, plan, 0), want_param)  # the padding stored as zeros, not the buffer's bytes
    assert torch.equal(_slot(whole, 0, plan, 1), opt.state[p]["exp_avg"])
    ahead = torch.full((plan.span,), 9, dtype=torch.uint8)
    plan.stage_static(ahead, 0)  # before a save's checks
    buf.add_(0)  # nothing changes between: the same bytes
    plan.stage(ahead, 0, plan.sources([]), static=False)
    assert torch.equal(ahead, whole)
    rest_only = torch.full((plan.span,), 9, dtype=torch.uint8)  # static=False copies no static source
    plan.stage(rest_only, 0, plan.sources([]), static=False)
    assert torch.equal(_slot(rest_only, 0, plan, 1), opt.state[p]["exp_avg"])
    assert bool((_slot(rest_only, 0, plan, 0)[:100].view(torch.uint8) == 9).all())


def _static_plan() -> tuple[Any, torch.Tensor]:
    """A plan with one static run (two views of one buffer) and one optimizer state looked up per save."""
    buf = torch.arange(1, 401, dtype=torch.float32)
    p = torch.nn.Parameter(torch.randn(6))
    opt = torch.optim.Adam([p])
    p.grad = torch.randn(6)
    opt.step()
    param = _Sliced("param", torch.empty(300), (300,), (0,))
    object.__setattr__(param, "pieces", [Piece(0, src=buf[0:100]), Piece(400, src=buf[100:300])])
    state = _Sliced("exp_avg", torch.empty(6), (6,), (0,))
    object.__setattr__(state, "pieces", [Piece(0, fetch=Fetch(opt, p, "exp_avg"))])
    plan = build_stage_plan([param, state])
    want = torch.full((plan.span,), 9, dtype=torch.uint8)
    plan.stage(want, 0, plan.sources([]))
    return plan, want


def _mapped(tmp_path: Path, nbytes: int, threaded: bool) -> StagingArena:
    path = tmp_path / "arena"
    path.write_bytes(b"\x09" * nbytes)
    path.chmod(0o600)  # a daemon's arena: private to its user, as the client requires
    arena = StagingArena(threaded=threaded)
    arena.map(str(path), nbytes)
    return arena


def test_with_a_core_to_spare_the_static_copy_runs_on_a_worker_and_the_save_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staging, "THREADED_STATIC_BYTES", 0)
    plan, want = _static_plan()
    threads: list[str] = []
    stage_static = plan.stage_static
    go = threading.Event()

    def on_which_thread(arena: torch.Tensor, base: int) -> None:
        assert go.wait(60)  # still copying when the save's own copy starts: it must wait for this one
        threads.append(threading.current_thread().name)
        stage_static(arena, base)

    monkeypatch.setattr(plan, "stage_static", on_which_thread)
    arena = _mapped(tmp_path, plan.span, threaded=True)
    arena.stage_static(plan, 0)
    assert threads == []  # started, not waited for
    threading.Timer(0.2, go.set).start()  # the copy goes on a moment later, as the save's own copy starts
    arena.stage_plan(plan, 0, plan.sources([]), static=False)
    assert threads and threads[0].startswith("ckptd-stage")
    assert torch.equal(arena._bytes(False), want)  # the static run, the looked-up state, in one span
    arena.close()
    # without a core to spare (or below the threshold) the same copy runs on the caller's thread, before
    serial = _mapped(tmp_path, plan.span, threaded=False)
    serial.stage_static(plan, 0)
    assert threads[-1] == threading.current_thread().name
    serial.stage_plan(plan, 0, plan.sources([]), static=False)
    assert torch.equal(serial._bytes(False), want)
    serial.close()


def test_a_failed_static_copy_on_the_worker_fails_the_save_or_is_logged_when_its_span_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(staging, "THREADED_STATIC_BYTES", 0)
    plan, _ = _static_plan()

    def broken(arena: torch.Tensor, base: int) -> None:
        raise RuntimeError("source freed")

    monkeypatch.setattr(plan, "stage_static", broken)
    arena = _mapped(tmp_path, plan.span, threaded=True)
    arena.stage_static(plan, 0)
    with pytest.raises(RuntimeError, match="source freed"):  # the save that takes the span over raises it
        arena.stage_plan(plan, 0, plan.sources([]), static=False)
    arena.stage_static(plan, 0)
    with caplog.at_level(logging.WARNING, logger="ckptd.client.staging"):
        arena.settle()  # a save that gives the span up (its checks failed): waited for, logged, not raised
    assert "source freed" in caplog.text
    arena.close()


@pytest.mark.parametrize(
    ("allowed", "node", "local_ranks", "spare"),
    [
        (2, 2, 1, True), (2, 2, 2, False), (16, 16, 8, True), (8, 8, 8, False),  # unbound: the node's cores shared
        (12, 96, 8, True), (1, 96, 8, False), (48, 96, 8, True),  # bound by the launcher: its own cores
    ],
)
def test_a_rank_has_a_core_to_spare_with_two_cores_to_itself(
    monkeypatch: pytest.MonkeyPatch, allowed: int, node: int, local_ranks: int, spare: bool
) -> None:
    monkeypatch.setattr(staging.os, "sched_getaffinity", lambda pid: set(range(allowed)))
    monkeypatch.setattr(staging.os, "cpu_count", lambda: node)
    assert staging.spare_core(local_ranks) is spare
