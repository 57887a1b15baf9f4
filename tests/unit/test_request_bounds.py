"""What one request may ask of the daemon is bounded before it is accepted: chunk grids that are costly to
plan, shards of tiny blocks (a file per element), too many chunks or shards, plans beyond their byte budget,
non-plain ``objects``, lease waits without end, options out of range; and chunks are written by a bounded
number of coroutines. Real saves (one block per shard, 10,000 small tensors) pass every bound."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from ckptd.client.protocol import PROTOCOL_VERSION, RegisterPlan, SaveRequest, ShardMeta, StepState
from ckptd.daemon import arena as arena_mod
from ckptd.daemon import plans
from ckptd.daemon.arena import Arena
from ckptd.daemon.config import DaemonConfig, load_config
from ckptd.daemon.plans import PlanRegistry, check_shards
from ckptd.daemon.service import CheckpointService
from ckptd.writer.backends import open_backend
from ckptd.writer.errors import (
    ConfigError,
    InvalidRequestError,
    PlanUnknownError,
    SaveTimeoutError,
    ShardLayoutError,
)
from ckptd.writer.format import plan_chunks


def _meta(shape: list[int], chunk: list[int] | None = None, gshape: list[int] | None = None,
          offset: list[int] | None = None, key: str = "w", slot: int = 0, dtype: str = "float32") -> ShardMeta:
    return ShardMeta(key, dtype, gshape or shape, offset or [0] * len(shape), shape, chunk or shape, slot)


def _slots(metas: list[ShardMeta]) -> list[int]:
    return [math.prod(m.shape) * 8 for m in metas]


def _reference_plan(base: list[int], item: int, target: int) -> tuple[int, ...]:
    """plan_chunks as it was written first (a linear search for the smallest divisor): the rule itself."""
    chunks = [max(1, int(n)) for n in base]
    for axis, n in enumerate(chunks):
        rest = math.prod(chunks[axis + 1:]) * item
        if math.prod(chunks) * item <= target:
            break
        for k in range(2, n + 1):
            if n % k == 0 and (n // k) * rest <= target:
                chunks[axis] = n // k
                break
        else:
            chunks[axis] = 1
    return tuple(chunks)


# --- chunk grids ------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_plan_chunks_keeps_its_rule_in_sqrt_time() -> None:
    rng = random.Random(47)
    for _ in range(3000):
        base = [rng.choice([0, 1, rng.randint(1, 300), rng.randint(1, 200_000)]) for _ in range(rng.randint(0, 3))]
        item, target = rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 7, 64, 4096, rng.randint(1, 1 << 20)])
        assert plan_chunks(base, item, target) == _reference_plan(base, item, target), (base, item, target)
    # 128 * a prime of 1e9: the smallest fitting divisor is 1e9+7, ~1e9 trials one by one; ~sqrt(n) now
    assert plan_chunks([128 * 1_000_000_007], 4) == (128,)
    assert plan_chunks([2 * 1_000_000_007, 3], 2, 1 << 20) == (2, 3)


@pytest.mark.timeout(60)
def test_a_zero_byte_shard_of_a_huge_grid_is_refused_at_once() -> None:
    """The reviewer's t2: a grid of 2**61-1 (a prime) took ~2**61 trials, on the daemon's event loop."""
    huge = 2**61 - 1
    with pytest.raises(ShardLayoutError, match="divisor trials"):
        check_shards([_meta([0], chunk=[huge], gshape=[huge])], [4096], "lease 1")


def test_tiny_blocks_are_refused_only_when_a_shard_spans_thousands() -> None:
    n = 1 << 18  # 1 MiB of float32
    with pytest.raises(ShardLayoutError, match="spans 262144 blocks"):  # a file per element
        check_shards([_meta([n], chunk=[1])], [4 * n], "lease 1")
    with pytest.raises(ShardLayoutError, match="spans 4097 blocks"):
        check_shards([_meta([4097, 3], chunk=[1, 3])], [4097 * 12], "lease 1")
    ok = [
        _meta([n], chunk=[n // 16]),  # 16 blocks of 64 KiB
        _meta([10, 3], chunk=[4, 3], key="edge"),  # a small grid chosen for another reader: 3 blocks
        _meta([4096, 3], chunk=[1, 3], key="rows"),  # one row a block, 4096 of them
        _meta([1], key="step"),  # a 4-byte tensor is one block
        _meta([1, 3], gshape=[8, 3], offset=[5, 0], key="rng"),  # a per-rank tensor: its row of (world, ...)
        _meta([1], chunk=[3], gshape=[10], offset=[9], key="tp"),  # the short last block of a TP split
        _meta([0, 7], chunk=[1, 7], gshape=[0, 7], key="empty"),
    ]
    ok = [msgspec.structs.replace(m, slot=i) for i, m in enumerate(ok)]
    check_shards(ok, _slots(ok), "lease 1")


def test_a_rank_of_10000_small_tensors_passes_and_too_many_chunks_or_shards_do_not() -> None:
    many = [_meta([4, 3], key=f"layers/{i}/w", slot=i) for i in range(10_000)]
    check_shards(many, _slots(many), "lease 1")
    # a 1-D block of a prime number of float32 over 16 MiB is cut into one-element chunks: 4 million files
    p = 4_194_319
    with pytest.raises(InvalidRequestError, match="more than the 1048576 one request may write"):
        check_shards([_meta([p])], [4 * p], "lease 1")
    over = [_meta([1], key=f"k{i}", slot=i) for i in range(100_001)]
    with pytest.raises(InvalidRequestError, match="more than the 100000 one request may have"):
        PlanRegistry().register(RegisterPlan(v=PROTOCOL_VERSION, rank=0, shards=over, offsets=[0] * len(over),
                                             sizes=[4] * len(over), span=4), owner=1)


# --- registered plans -------------------------------------------------------------------------------------
def _plan(n: int, key: str = "k") -> RegisterPlan:
    shards = [_meta([1], key=f"{key}{i}", slot=i) for i in range(n)]
    return RegisterPlan(v=PROTOCOL_VERSION, rank=0, shards=shards, offsets=[8 * i for i in range(n)], sizes=[8] * n,
                        span=8 * n)


def test_registered_plans_stay_within_their_byte_budgets() -> None:
    one = plans.plan_cost(_plan(100))
    reg = PlanRegistry(connection_bytes=int(2.5 * one), total_bytes=int(4.5 * one))
    a, b, c = (reg.register(_plan(100, key), owner=1) for key in "abc")  # a connection holds two at most
    with pytest.raises(PlanUnknownError):
        reg.get(a)  # its oldest went: its client registers it again when it saves with it
    assert reg.get(b).plan_id == b and reg.get(c).plan_id == c
    d, e = (reg.register(_plan(100, key), owner=2) for key in "de")  # and the daemon four
    reg.get(d)
    reg.register(_plan(100, "f"), owner=3)  # the least recently used goes: b (c was used after it)
    with pytest.raises(PlanUnknownError):
        reg.get(b)
    assert {reg.get(x).plan_id for x in (c, d, e)} == {c, d, e}
    with pytest.raises(InvalidRequestError, match="a connection's plans may hold"):
        reg.register(_plan(300), owner=4)  # over a connection's whole budget: refused, nothing dropped
    reg.forget(1)
    reg.forget(2)
    assert reg.register(_plan(100, "g"), owner=1)


def test_a_plans_cost_is_what_the_daemon_holds_for_it() -> None:
    """The estimate is within 30% of the bytes a decoded plan keeps (tracemalloc), for short and long keys."""
    import tracemalloc

    from ckptd.client.protocol import decode_request, encode

    for key, shape in (("k", [1]), ("model/decoder/layers.{}.self_attention.linear_qkv.weight", [1, 4096, 4096])):
        shards = [_meta(shape, gshape=[32, *shape[1:]] if len(shape) > 1 else [5000], key=key.format(i), slot=i,
                        offset=[i % 32] + [0] * (len(shape) - 1) if len(shape) > 1 else [i])
                  for i in range(5000)]
        body = encode(RegisterPlan(v=PROTOCOL_VERSION, rank=0, shards=shards, offsets=list(range(5000)),
                                   sizes=[1] * 5000, span=5000), 1 << 30)[4:]
        tracemalloc.start()
        msg = decode_request(body)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert isinstance(msg, RegisterPlan)
        assert 0.7 < plans.plan_cost(msg) / held < 1.3, (key, plans.plan_cost(msg), held)


# --- a save in a daemon's service, in this process --------------------------------------------------------
@contextlib.asynccontextmanager
async def _service(tmp_path: Path, **config: Any) -> AsyncIterator[tuple[CheckpointService, Arena]]:
    (tmp_path / "shm").mkdir()
    cfg = DaemonConfig(root=str(tmp_path / "root"), socket=str(tmp_path / "s.sock"), arena_size=2 << 20,
                       retain=False, stage_grace_s=0, **config)
    arena = Arena(cfg.arena_size, shm_dir=str(tmp_path / "shm"), prefault=False)
    try:
        yield CheckpointService(cfg, arena, await open_backend(cfg.root, None, create=True)), arena
    finally:
        arena.close()


def _request(lease_id: int, shards: list[ShardMeta], objects: dict[str, Any], rank: int = 0,
             world: int = 1) -> SaveRequest:
    return SaveRequest(v=PROTOCOL_VERSION, lease_id=lease_id, step=3, rank=rank, world_size=world, node=0,
                       num_nodes=1, local_world_size=world, shards=shards, objects=objects)


@pytest.mark.parametrize("bad", [
    msgspec.msgpack.Ext(5, b"x"),  # the reviewer's t3
    b"\x00\x01",
    datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC),
    {"nested": {1: "an int key"}},
    [1, [2, {"deep": {3, 4}}]],
])
def test_objects_that_are_not_plain_data_are_refused_before_the_save_is_accepted(tmp_path: Path, bad: Any) -> None:
    async def go() -> None:
        async with _service(tmp_path) as (svc, arena):
            lease = await arena.lease(7, [64], 1.0)
            req = _request(lease.lease_id, [_meta([16])], {"lr": 0.1, "bad": bad})
            with pytest.raises(InvalidRequestError, match=r"plain data|not a string"):
                await svc.accept(req, 7)
            assert svc.jobs == {}  # no step started: the node's other ranks are not failed by it
            good = _request(lease.lease_id, [_meta([16])], {"lr": 0.1, "sched": {"it": [1, 2.5, None, True]}})
            await svc.accept(good, 7)
            assert (await svc.status(3, 30.0))[0] is StepState.COMMITTED

    asyncio.run(go())


def test_one_node_with_fewer_local_ranks_than_the_world_is_refused(tmp_path: Path) -> None:
    """On one node every rank is local: a save saying otherwise would commit without the others' data."""
    async def go() -> None:
        async with _service(tmp_path) as (svc, arena):
            lease = await arena.lease(7, [64], 1.0)
            req = msgspec.structs.replace(_request(lease.lease_id, [_meta([16])], {}, world=2), local_world_size=1)
            with pytest.raises(InvalidRequestError, match="not all of it on one node"):
                await svc.accept(req, 7)
            assert svc.jobs == {}

    asyncio.run(go())


def test_chunks_are_written_by_a_bounded_number_of_coroutines(tmp_path: Path) -> None:
    """A 1 MiB shard cut into 256 chunks of 4 KiB (``--chunk-bytes 4KiB``): two writers at a time, not a task
    per chunk; every chunk lands, bit-exact."""
    n = 1 << 18
    data = np.arange(n, dtype=np.float32)
    peak = 0

    async def go() -> None:
        nonlocal peak
        async with _service(tmp_path, chunk_bytes=4096, write_concurrency=2) as (svc, arena):
            put = svc.writer._sink.put

            async def counted(*args: Any, **kwargs: Any) -> Any:
                nonlocal peak
                peak = max(peak, len(asyncio.all_tasks()))
                return await put(*args, **kwargs)

            svc.writer._sink.put = counted  # type: ignore[method-assign]
            lease = await arena.lease(7, [4 * n], 1.0)
            np.frombuffer(arena.mm, dtype=np.float32, count=n, offset=lease.offsets[0])[:] = data
            await svc.accept(_request(lease.lease_id, [_meta([n])], {}), 7)
            assert (await svc.status(3, 60.0))[0] is StepState.COMMITTED

    asyncio.run(go())
    assert peak <= 10, peak  # the step's own tasks and two chunk writers (a task per chunk: over 256)
    folder = tmp_path / "root" / "step_3" / "w"
    chunks = sorted(f for f in os.listdir(folder) if f.startswith("c."))
    assert len(chunks) == 256
    import zarr

    assert np.array_equal(zarr.open_array(str(folder), mode="r")[:], data)


# --- lease waits ------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_lease_wait_has_an_end_whatever_the_request_asks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena_mod, "MAX_LEASE_WAIT_S", 0.3, raising=False)

    async def go() -> None:
        arena = Arena(1 << 20, shm_dir=str(tmp_path), prefault=False)
        try:
            await arena.lease(1, [1 << 20], 1.0)  # the arena is full
            for forever in (math.inf, 1e300):
                with pytest.raises(SaveTimeoutError):
                    await asyncio.wait_for(arena.lease(2, [4096], forever), 10)
        finally:
            arena.close()

    asyncio.run(go())


# --- options ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "env", "match"), [
    ({"read_timeout_s": 0}, {}, "read_timeout_s"),
    ({}, {"CKPTD_READ_TIMEOUT_S": "0"}, "read_timeout_s"),
    ({"part_timeout_s": -5}, {}, "part_timeout_s"),
    ({"commit_timeout_s": math.nan}, {}, "commit_timeout_s"),
    ({}, {"CKPTD_COMMIT_TIMEOUT_S": "inf"}, "commit_timeout_s"),
    ({"stage_grace_s": math.inf}, {}, "stage_grace_s"),
    ({"stage_grace_s": -0.1}, {}, "stage_grace_s"),
    ({"drain_grace_s": -1}, {}, "drain_grace_s"),
    ({"drain_grace_s": math.nan}, {}, "drain_grace_s"),
    ({"restore_hold_s": math.inf}, {}, "restore_hold_s"),
    ({"exit_when_idle_s": math.inf}, {}, "exit_when_idle_s"),
    ({"chunk_bytes": "3"}, {}, "chunk_bytes"),
    ({"max_frame_bytes": "16GiB"}, {}, "max_frame_bytes"),
    ({"nice": -50}, {}, "nice"),
    ({"storage": {"connect_timeout": math.inf}}, {}, "connect_timeout"),
    ({"root": ""}, {}, "root is empty"),
    ({"root": "  "}, {}, "root is empty"),
    ({"root": "file://"}, {}, "root is empty"),
])
def test_options_out_of_range_are_config_errors(flags: dict[str, Any], env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config({"root": "/r", **flags}, env)


def test_options_at_their_bounds_are_accepted() -> None:
    cfg = load_config({"root": "/r", "stage_grace_s": 0, "drain_grace_s": 0, "chunk_bytes": "4KiB", "nice": 19,
                       "max_frame_bytes": "4095MiB", "read_timeout_s": 0.5}, {})
    assert (cfg.stage_grace_s, cfg.drain_grace_s, cfg.chunk_bytes, cfg.nice) == (0, 0, 4096, 19)
    with pytest.raises(ConfigError, match="root is empty"):
        load_config({}, {"CKPTD_ROOT": ""})
