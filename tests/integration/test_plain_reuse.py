"""The plain ``save()`` path reuses a registered plan while the state's structure repeats, and a save after
any structure change (dtype, shape, a new key) is staged right: every step reloads bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.protocol import PROTOCOL_VERSION, ReportRequest
from ckptd.client.reader import load
from ckptd.writer.errors import ShardLayoutError, StepCommittedError


def _state(seed: int, a_dtype: torch.dtype = torch.float32, a_rows: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(a_rows, 3, generator=g).to(a_dtype),
        "b": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "c": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "t": torch.randn(3, 6, generator=g).t(),  # non-contiguous source
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _status(socket: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "ckptd.daemon.cli", "status", "--socket", socket, "--json"],
                         capture_output=True, text=True, timeout=60)
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def _arena(client: CheckpointClient) -> tuple[int, int]:
    """(leases, arena bytes in use) from the daemon's status report (what ``ckptd status --json`` prints)."""
    r = client._request(ReportRequest(v=PROTOCOL_VERSION))
    return r.leases, r.arena_bytes - r.arena_free_bytes  # type: ignore[attr-defined]


# plan saves ask for the next save's span with their request (assume_constant_structure: and wait for no
# answer); a save of another structure gives that lease back first (a leak would leave one lease per
# structure change)
@pytest.mark.parametrize("constant", [False, True])
def test_repeated_structure_is_saved_through_one_plan_and_changes_reload_bit_exact(start_daemon, tmp_path, constant):
    d = start_daemon(str(tmp_path / "ckpt"), "d0")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), assume_constant_structure=constant)
    plans: list[Any] = []
    steps = [
        _state(1), _state(2), _state(3),  # the 2nd save plans, the 3rd reuses
        _state(4, a_dtype=torch.float64), _state(5, a_dtype=torch.float64),  # a dtype change: planned again
        _state(6, a_rows=9), _state(7, a_rows=9),  # resized
        {**_state(8), "new": torch.ones(2)}, {**_state(9), "new": torch.zeros(2)},  # a new key
    ]
    for step, state in enumerate(steps, 1):
        saved = {k: v.clone() for k, v in state.items()}
        handle = client.save(step, state)
        for v in state.values():  # the caller may overwrite its tensors as soon as save() returns
            v.fill_(0)
        handle.wait(60)
        plans.append(client._repeats._cache._plans.get("plain"))
        out = {k: torch.full_like(v, 7) for k, v in saved.items()}
        load(d.root, step, out)
        for k, v in saved.items():
            assert torch.equal(_bits(out[k]), _bits(v)), (step, k)
    # a plan save's span is kept whole for an in-memory restore, then freed once: the arena adds up
    report = _status(d.socket)
    # only the newest step's span stays (a few hundred bytes: one 4 KiB arena page), plus the one lease
    # granted ahead for the next save
    used = report["arena_bytes"] - report["arena_free_bytes"]  # whole 4 KiB pages
    assert 0 < report["arena_retained_bytes"] <= 4096, report
    assert (report["leases"], used) == (1, 8192), report
    client.close()
    probe = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    for _ in range(100):  # the daemon frees a departed client's leases once it sees the connection end
        if _arena(probe) == (0, 4096):
            break
        time.sleep(0.05)
    assert _arena(probe) == (0, 4096)
    probe.close()
    assert "double free" not in (Path(tmp_path) / "d0.log").read_text()
    assert plans[0] is None and plans[1] is not None and plans[2] is plans[1]
    assert plans[1].registered is not None and plans[1].registered[1] > 0
    # each new structure: per-shard on its first save, its own plan from the second
    assert plans[3] is plans[2] and plans[4] is not plans[2]
    assert plans[5] is plans[4] and plans[6] is not plans[4]
    assert plans[7] is plans[6] and plans[8] is not plans[6]
    assert len({id(p) for p in plans[1:]}) == 4
    assert {m.key for m in plans[8].metas} == set(steps[8])


def test_constant_structure_delivers_a_refused_save_at_wait_and_frees_its_lease(start_daemon, tmp_path):
    """Under the promise a plan save does not wait for the daemon's answer: a save the daemon refuses (the
    step already committed) returns a handle whose ``wait()`` raises the typed error, its lease is given
    back, and the next save goes on."""
    d = start_daemon(str(tmp_path / "ckpt"), "d0", arena="16MiB")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0), assume_constant_structure=True)
    for step in (1, 2):  # the second save of a structure plans (and pipelines)
        client.save(step, _state(step)).wait(60)
    handle = client.save(2, _state(3))  # refused once the daemon reads it: step 2 committed
    with pytest.raises(StepCommittedError):
        handle.wait(60)
    assert _arena(client)[0] <= 1  # at most the lease granted ahead for the next save: none leaked
    state = _state(4)
    client.save(3, state).wait(60)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    load(d.root, 3, out)
    assert all(torch.equal(_bits(out[k]), _bits(v)) for k, v in state.items())
    client.close()


def test_a_checked_plan_save_copies_into_the_lease_asked_for_with_the_previous_save(start_daemon, tmp_path):
    """Without the promise a plan save still waits for the daemon's answer (a refusal raises at once), but
    asks for the next save's staging space in the same exchange: one round trip a save, not two."""
    d = start_daemon(str(tmp_path / "ckpt"), "d0", arena="16MiB")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    for step in (1, 2, 3):  # the second save of a structure plans, the third reuses the plan
        client.save(step, _state(step)).wait(60)
    held = client._pipe.held  # asked for with step 3's save; its answer was read by that save's wait()
    assert held is not None
    state = _state(4)
    saved = {k: v.clone() for k, v in state.items()}
    handle = client.save(4, state)
    # the save took the held lease and asked for the next one, whose answer is still unread
    assert client._pipe.held is None and len(client._pipe.owed) == 1
    handle.wait(60)
    out = {k: torch.full_like(v, 7) for k, v in saved.items()}
    load(d.root, 4, out)
    assert all(torch.equal(_bits(out[k]), _bits(v)) for k, v in saved.items())
    with pytest.raises(StepCommittedError):  # refused by the daemon: raised by save() itself
        client.save(4, _state(5))
    # refused when the daemon started the step (PrepareStep), before the save request that would have asked
    # for the next lease: the refused save's lease was given back, and nothing else is held
    assert _arena(client)[0] == 0
    client.close()


def _two_ranks_save_and_reload(socket: str, root: str, steps: int = 5) -> None:
    """Two local ranks (two connections) save 4 MiB each per step, rank 0 first, then wait for the step;
    the last step reloads bit-exact for both."""
    clients = [CheckpointClient(socket, placement=Placement(r, 2, 2, 0), timeout_s=20) for r in (0, 1)]
    rows = 1 << 18  # 4 MiB a rank
    states = [{"w": Shard("w", torch.full((rows, 4), float(r)), (2 * rows, 4), (r * rows, 0))} for r in (0, 1)]
    for step in range(1, steps + 1):
        handles = []
        for state, client in zip(states, clients, strict=True):  # rank 0 first: its step waits for rank 1
            state["w"].data.add_(1)
            handles.append(client.save(step, state))
        for h in handles:
            h.wait(60)
    for r, state in enumerate(states):
        out = {"w": Shard("w", torch.zeros(rows, 4), (2 * rows, 4), (r * rows, 0))}
        load(root, steps, out, rank=r)
        assert torch.equal(out["w"].data, state["w"].data), r
    for c in clients:
        c.close()


def test_a_lease_asked_for_ahead_leaves_room_for_the_local_saves_still_due(start_daemon, tmp_path):
    """Two local ranks, an arena of two and a half saves, the in-memory restore on (the default): the rank
    that saves a step first must not take, for its next save, the space the other rank's save of that step
    needs (from the third save on, each save is a plan save that asks ahead). Before, it did (after evicting
    the kept step, with its own save's span kept for the step in flight): the other rank waited for space
    held until the first rank's next save, and timed out."""
    d = start_daemon(str(tmp_path / "ckpt"), "d0", arena="10MiB")
    _two_ranks_save_and_reload(d.socket, d.root)


def test_a_waiting_save_gets_the_space_kept_for_its_step_once_written(start_daemon, tmp_path):
    """An arena of one and a half saves: the second rank's save waits until the first rank's bytes are
    written (after the stage grace), then evicts them from the in-memory restore's keeping. Before, keeping
    them woke no waiter: the save waited until it timed out, though with the restore off it went through."""
    d = start_daemon(str(tmp_path / "ckpt"), "d0", "--stage-grace", "0.3", arena="6MiB")
    _two_ranks_save_and_reload(d.socket, d.root, steps=3)


def _nested(step: int, rows: int = 5, rank: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    part = torch.randn(2 * rows, generator=g)  # both ranks' halves, each rank saving its own
    return {
        "model": {"w": torch.randn(rows, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)},
        "meta": {"step": step, "name": f"s{step}", "lrs": [0.1 * step]},
        "opt": {"exp_avg": torch.randn(rows * 3, generator=g), "count": step * 10,
                "part": Shard("opt/part", part[rank * rows : (rank + 1) * rows].clone(), (2 * rows,), (rank * rows,))},
    }


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{k}/{n}": t.data if isinstance(t, Shard) else t
            for k, sub in state.items() for n, t in sub.items() if isinstance(t, (torch.Tensor, Shard))}


def test_a_dict_shaped_like_a_planned_one_skips_planning_and_saves_its_current_values(
    start_daemon, tmp_path, monkeypatch
):
    """Once a structure has a plan, a dict of the same shape is staged through it without being planned shard by
    shard (``plan_state`` is not called), with this save's tensors and plain values; a dict of another shape is
    planned again. Two ranks, each writing its half of a sharded tensor (a ``Shard`` leaf); rank 1's plain
    tensors are non-main replicas, staged by nobody (registered with its plan once: no replica regions sent
    with each save)."""
    from ckptd.client import reuse

    calls = {0: 0, 1: 0}
    real = reuse.plan_state
    monkeypatch.setattr(reuse, "plan_state", lambda state, rank, **kw: calls.__setitem__(rank, calls[rank] + 1) or
                        real(state, rank, **kw))
    d = start_daemon(str(tmp_path / "ckpt"), "d0")
    clients = [CheckpointClient(d.socket, placement=Placement(r, 2, 2, 0)) for r in (0, 1)]
    planned = []
    rows = {1: 5, 2: 5, 3: 5, 4: 5, 5: 7, 6: 7, 7: 7}  # step 5 resizes: planned twice more, then skipped again
    for step, n in rows.items():
        before = dict(calls)
        states = [_nested(step, n, 0), _nested(step, n, 1)]
        saved = [{k: v.clone() for k, v in _tensors(s).items()} for s in states]
        whole = torch.cat([saved[0]["opt/part"], saved[1]["opt/part"]])
        handles = [c.save(step, s) for c, s in zip(clients, states, strict=True)]
        for s in states:
            for t in _tensors(s).values():
                t.fill_(0)  # the caller may overwrite its tensors as soon as save() returns
        for h in handles:
            h.wait(60)
        planned.append(tuple(calls[r] - before[r] for r in (0, 1)))
        template = _nested(0, n)
        template["opt"]["part"] = torch.full((2 * n,), 7.0)  # both halves
        for t in _tensors(template).values():
            t.fill_(7)
        got = load(d.root, step, template)
        for k, t in _tensors(got).items():
            assert torch.equal(_bits(t), _bits(whole if k == "opt/part" else saved[0][k])), (step, k)
        assert got["meta"] == {"step": step, "name": f"s{step}", "lrs": [0.1 * step]}, step
        assert got["opt"]["count"] == step * 10
    assert planned == [(1, 1), (1, 1), (0, 0), (0, 0), (1, 1), (1, 1), (0, 0)]
    # rank 1 holds a plain tensor under a key rank 0 lacks: a replica nobody wrote fails the step on both
    # ranks, whether rank 1 planned it (8), saved it through its replica-only plan (9) or skipped planning (10)
    for step in (8, 9, 10):
        before = calls[1]
        extra = {**_nested(step, 7, 1), "only_r1": torch.ones(3)}
        handles = [clients[0].save(step, _nested(step, 7)), clients[1].save(step, extra)]
        assert calls[1] - before == (0 if step == 10 else 1)
        for h in handles:
            with pytest.raises(ShardLayoutError, match="only_r1"):
                h.wait(60)
    for c in clients:
        c.close()


def test_a_refused_pipelined_save_leaves_its_sidecars_to_the_next_save(start_daemon, tmp_path):
    """Sidecars count as sent once the daemon accepted the save that carried them: a pipelined save refused
    (its step committed already) left them unsent, and the next save, which names them, must carry them, or
    its step commits naming a sidecar never stored."""
    from ckptd.client.planbuild import build_stage_plan
    from ckptd.writer.format import sidecar_key, sidecar_name

    root = str(tmp_path / "ckpt")
    d = start_daemon(root)
    doc = '{"layout": "rank0"}'
    t = torch.randn(1 << 14)
    plan = build_stage_plan([Shard("w", t, tuple(t.shape), (0,))])
    first = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    first.save_staged(3, plan, [], {}, pipelined=False).wait(30)
    first.close()
    again = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))  # a trainer restarted from step 2
    refused = again.save_staged(3, plan, [], {"ref": sidecar_name(doc)}, sidecars=[doc], pipelined=True)
    with pytest.raises(StepCommittedError):
        refused.wait(30)
    again.save_staged(4, plan, [], {"ref": sidecar_name(doc)}, sidecars=[doc], pipelined=True).wait(30)
    again.close()
    assert (Path(root) / sidecar_key(sidecar_name(doc))).read_text() == doc
