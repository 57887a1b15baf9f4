"""The ranks of a load agree on the step and, before anything is written, on whether every one can load.

A rank that refuses (its slice names a param no saved state covers, a storage error while it plans) must not
leave the others loading on into the trainer's next collective, where they would wait for it until the
process group timed out; and ranks that resolve ``"latest"`` a moment apart, while the job before still
commits, must not load two steps. First :class:`LoadAgreement` alone on three gloo ranks, then a real load
(a daemon, the toy GPT) where one rank resolved ``"latest"`` before the newest step committed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from ckptd.client import CheckpointClient
from ckptd.client.megatron import load_checkpoint, save_checkpoint
from ckptd.client.megatron.agree import LoadAgreement
from ckptd.testing.toy_gpt import build_gpt, spawn_ranks, spawn_with_daemon
from ckptd.writer.errors import (
    CheckpointNotFoundError,
    CkptdError,
    CorruptCheckpointError,
    StateMismatchError,
    StorageError,
)
from ckptd.writer.root import CheckpointRoot

pytestmark = pytest.mark.megatron

TINY = {"hidden": 32, "layers": 2, "heads": 4}


def _outcome(agreement: LoadAgreement, refusal: BaseException | None, late: BaseException | None = None) -> str:
    """What one rank's load does, as ``load_checkpoint_async`` calls the agreement: refuse before the verdict
    (its own error), raise a peer's at the verdict, or write; then fail while writing (``late``: its own
    error), raise a peer's failure at the end, or finish ("write")."""
    try:
        if refusal is not None:
            raise refusal
        agreement.verdict()
        if late is not None:
            raise late
    except BaseException as exc:
        agreement.refuse(exc)
        return f"own {type(exc).__name__}" if exc is refusal or exc is late else f"{type(exc).__name__}: {exc}"
    try:
        agreement.done()
    except CkptdError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "write"


def _agreements(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. the step: the highest any rank resolved; a rank that found none takes it too; none anywhere: None
    out["step"] = LoadAgreement().step({0: 10, 1: None, 2: 12}[rank])
    out["none"] = LoadAgreement().step(None)
    ok = LoadAgreement()
    ok.step(5)
    out["all_can"] = _outcome(ok, None)
    # 2. two ranks refuse: every other rank raises the lowest refusing rank's error class, naming it
    two = LoadAgreement()
    two.step(5)
    refusals: dict[int, BaseException] = {1: StateMismatchError("a param no saved state covers"),
                                         2: CorruptCheckpointError("a chunk's crc32c")}
    out["two_refuse"] = _outcome(two, refusals.get(rank))
    # 3. a rank fails before the step is agreed (its storage times out while it resolves): the collectives
    # stay paired, and the others learn it at the verdict
    early = LoadAgreement()
    if rank == 0:
        early.refuse(StorageError("a read timed out after its retries"))
        out["early"] = "own StorageError"
    else:
        out["early_step"] = early.step(7)
        out["early"] = _outcome(early, None)
    # 4. an error that is not ckptd's: the others raise CkptdError naming the rank
    foreign = LoadAgreement()
    foreign.step(7)
    out["foreign"] = _outcome(foreign, RuntimeError("a bug") if rank == 2 else None)
    # 6. the group itself fails in a collective (a peer gone, a timeout): nothing more is sent on it
    failing = LoadAgreement()
    real, calls = torch.distributed.all_reduce, []

    def broken(*a: Any, **k: Any) -> None:
        calls.append(a)
        raise RuntimeError("Application timeout caused pair closure")

    torch.distributed.all_reduce = broken  # type: ignore[assignment]
    try:
        failing.step(7)
    except RuntimeError as exc:
        failing.refuse(exc)
        failing.verdict()
    finally:
        torch.distributed.all_reduce = real
    out["after_failure"] = len(calls)
    # 5. after a verdict that let every rank write, a rank that fails (a read) is heard at the end: the others
    # raise its error class, naming it; a rank interrupted before the verdict is a refusing one
    late = LoadAgreement()
    late.step(7)
    out["late"] = _outcome(late, None, CorruptCheckpointError("a chunk's crc32c differs") if rank == 1 else None)
    interrupted = LoadAgreement()
    interrupted.step(7)
    out["interrupted"] = _outcome(interrupted, KeyboardInterrupt() if rank == 2 else None)
    # 8. the flag tensor is made once, with the agreement: no allocation after the load (a device it filled,
    # CUDA out of memory, would fail every later one, refuse()'s too) ...
    real_tensor, real_fill = torch.tensor, torch.Tensor.fill_

    def no_memory(*a: Any, **k: Any) -> torch.Tensor:
        raise RuntimeError("CUDA out of memory (simulated)")

    full = LoadAgreement()
    full.step(7)
    full.verdict()
    if rank == 1:
        torch.tensor = no_memory  # type: ignore[assignment]
    try:
        full.done()
        out["no_allocation"] = "write"
    finally:
        torch.tensor = real_tensor  # type: ignore[assignment]
    # ... and an end that fails before its all-reduce still makes it, through refuse() as the load's wrapper
    # calls it: the others hear the failure, nothing unpaired
    before = LoadAgreement()
    before.step(7)
    before.verdict()
    if rank == 1:
        torch.Tensor.fill_ = no_memory  # type: ignore[method-assign]
    try:
        before.done()
        out["before_collective"] = "write"
    except RuntimeError as exc:
        torch.Tensor.fill_ = real_fill  # type: ignore[method-assign]
        before.refuse(exc)
        out["before_collective"] = "own RuntimeError"
    except CkptdError as exc:
        out["before_collective"] = f"{type(exc).__name__}: {exc}"
    finally:
        torch.Tensor.fill_ = real_fill  # type: ignore[method-assign]
    # 7. nothing after the last collective: a later error, another done(), an end every rank met alike
    once = LoadAgreement()
    once.step(7)
    once.verdict()
    once.done()
    once.refuse(StorageError("after the load"))
    once.done()
    alike = LoadAgreement()
    alike.step(None)
    alike.verdict(last=True)  # no rank found a step: every rank raises here, nothing written
    alike.refuse(StorageError("no committed step"))
    alike.done()
    torch.distributed.barrier()  # would pair with a stray all-reduce of another rank and fail or hang
    out["after"] = "ok"
    return out


def test_the_ranks_agree_on_the_step_and_the_verdict() -> None:
    results = spawn_ranks(_agreements, 3, timeout_s=120)
    assert [r["step"] for r in results] == [12, 12, 12]
    assert [r["none"] for r in results] == [None, None, None]
    assert [r["all_can"] for r in results] == ["write"] * 3
    assert results[1]["two_refuse"] == "own StateMismatchError"
    assert results[2]["two_refuse"] == "own CorruptCheckpointError"
    told = results[0]["two_refuse"]
    assert told.startswith("StateMismatchError: rank 1 refused this load (StateMismatchError"), results
    assert "no rank has written" in told
    assert [r.get("early_step") for r in results] == [None, 7, 7]
    assert results[0]["early"] == "own StorageError"
    for r in results[1:]:
        assert r["early"].startswith("StorageError: rank 0 refused this load (StorageError"), results
    for r in results[:2]:
        assert r["foreign"].startswith("CkptdError: rank 2 refused this load (CkptdError"), results
    assert results[1]["late"] == "own CorruptCheckpointError"
    for r in (results[0], results[2]):
        assert r["late"].startswith("CorruptCheckpointError: rank 1 failed while loading, after every rank had "
                                    "begun writing"), results
    assert results[2]["interrupted"] == "own KeyboardInterrupt"
    for r in results[:2]:
        assert r["interrupted"].startswith("CkptdError: rank 2 refused this load"), results
    assert [r["no_allocation"] for r in results] == ["write"] * 3
    assert results[1]["before_collective"] == "own RuntimeError"
    for r in (results[0], results[2]):
        assert r["before_collective"].startswith("CkptdError: rank 1 failed while loading"), results
    assert [r["after"] for r in results] == ["ok"] * 3
    assert [r["after_failure"] for r in results] == [1, 1, 1]


def test_one_process_agrees_without_a_collective() -> None:
    agreement = LoadAgreement()  # no process group here
    assert agreement.step(3) == 3 and LoadAgreement().step(None) is None
    agreement.verdict()
    agreement.refuse(StorageError("after the verdict: nothing to tell"))
    agreement.done()


def _latest_a_moment_apart(rank: int, world: int, socket: str, root: str) -> dict[str, Any]:
    """Save steps 1 and 2; rank 1 then resolves ``"latest"`` as it read before step 2 committed (step 1).
    Both ranks must load step 2, bit for bit what they saved there. Then step 1 by number: a rollback, which
    the first rank's log tells (``latest`` and retention still go by step number)."""
    model, optimizer, train_step = build_gpt(**TINY)
    client = CheckpointClient(socket, timeout_s=60)
    saved: dict[int, list[torch.Tensor]] = {}
    for step in (1, 2):
        train_step(step)
        save_checkpoint(client, step, model, optimizer).wait(60)
        saved[step] = [p.detach().clone() for p in model[0].parameters()]
    client.close()
    model2, optimizer2, train_step2 = build_gpt(**TINY, seed=99)
    train_step2(0)
    if rank == 1:
        real = CheckpointRoot.resolve

        async def before_the_commit(self: CheckpointRoot, step: int | str) -> int:
            return 1 if step == "latest" else await real(self, step)

        CheckpointRoot.resolve = before_the_commit  # type: ignore[method-assign]
    loaded = load_checkpoint(root, "latest", model2, optimizer2)
    live = list(model2[0].parameters())
    out = {"step": loaded.step,
           "equal_2": all(torch.equal(a, b) for a, b in zip(saved[2], live, strict=True)),
           "equal_1": all(torch.equal(a, b) for a, b in zip(saved[1], live, strict=True))}
    # step 1 loaded by number while step 2 is committed: a rollback, told once (by rank 0)
    told: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: told.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptd.client.megatron.agree").addHandler(handler)
    out["rollback_step"] = load_checkpoint(root, 1, model2, optimizer2).step
    out["told"] = [m for m in told if "newest committed" in m]
    return out


def test_ranks_that_resolve_latest_apart_load_the_same_step(tmp_path: Path, module_sockdir: str) -> None:
    results = spawn_with_daemon(_latest_a_moment_apart, 2, str(tmp_path / "root"),
                                os.path.join(module_sockdir, "apart.sock"), log_path=str(tmp_path / "apart.log"))
    assert [r["step"] for r in results] == [2, 2], results
    assert all(r["equal_2"] and not r["equal_1"] for r in results), results
    assert [r["rollback_step"] for r in results] == [1, 1]
    (told,) = results[0]["told"]
    assert "loading step 1 while step 2 is the newest committed" in told and "--after 1" in told, told
    assert results[1]["told"] == []


def _outcome_of(fn: Any) -> str:
    try:
        return f"returned {fn()}"
    except CkptdError as exc:
        return f"{type(exc).__name__}: {exc}"


def _refusals_before_the_step(rank: int, world: int, socket: str, root: str) -> dict[str, str]:
    """Failures that come before the step is agreed on one rank only: the root cannot be opened there (it does
    not exist; storage refuses), resolving fails there while no rank finds a step, a layout sidecar is missing
    there. The other rank must raise too (the same class, naming the rank), never wait in a collective, and
    Megatron-LM's loader must not start from scratch over a committed step; a root that exists nowhere is a
    start from scratch on every rank."""
    import argparse

    from ckptd.client.megatron import megatron_lm
    from ckptd.writer import root as opened

    model, optimizer, train_step = build_gpt(**TINY)
    train_step(0)
    client = CheckpointClient(socket, timeout_s=60)
    save_checkpoint(client, 1, model, optimizer).wait(60)
    client.close()
    out: dict[str, str] = {}
    out["missing_here"] = _outcome_of(lambda: load_checkpoint(root if rank == 0 else root + "-nowhere", "latest",
                                                              model, optimizer).step)
    out["missing_everywhere"] = _outcome_of(lambda: load_checkpoint(root + "-nowhere", "latest", model, optimizer))
    args = argparse.Namespace(load=root + "-nowhere", finetune=False, no_load_optim=False, no_load_rng=False,
                              exit_on_missing_checkpoint=False, ckpt_step=None)
    out["megatron_lm_missing_everywhere"] = _outcome_of(lambda: megatron_lm.load_checkpoint(model, optimizer, None,
                                                                                            args=args))
    args.ckpt_step = 1  # a step named under a root that is not there: an error, not a start from scratch
    out["megatron_lm_named_missing"] = _outcome_of(lambda: megatron_lm.load_checkpoint(model, optimizer, None,
                                                                                       args=args))
    args.ckpt_step = None
    real_verdict = LoadAgreement.verdict

    def verdict_fails(self: LoadAgreement, *, last: bool = False) -> None:
        if last:  # the end every rank meets alike (no step anywhere), failing before its all-reduce here
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        real_verdict(self, last=last)

    if rank == 1:
        LoadAgreement.verdict = verdict_fails  # type: ignore[method-assign]
    try:
        load_checkpoint(root + "-nowhere", "latest", model, optimizer)
    except (CkptdError, RuntimeError) as exc:
        out["nowhere_verdict_fails"] = f"{type(exc).__name__}: {exc}"
    finally:
        LoadAgreement.verdict = real_verdict  # type: ignore[method-assign]
    real_open, real_resolve, real_sidecar = opened.open_backend, CheckpointRoot.resolve, CheckpointRoot.read_sidecar

    async def refused_open(*a: Any, **k: Any) -> Any:
        raise StorageError("HEAD: 503 Slow Down, after its retries")

    async def refused_resolve(self: CheckpointRoot, step: int | str) -> int:
        raise StorageError("LIST: 503 Slow Down, after its retries")

    async def no_sidecar(self: CheckpointRoot, name: str) -> str:
        raise CheckpointNotFoundError(f"sidecar {name} not found")

    if rank == 1:
        opened.open_backend = refused_open  # type: ignore[assignment]
    out["open_refused"] = _outcome_of(lambda: load_checkpoint(root, "latest", model, optimizer).step)
    opened.open_backend = real_open  # type: ignore[assignment]
    if rank == 1:
        CheckpointRoot.resolve = refused_resolve  # type: ignore[method-assign]
    out["none_and_refused"] = _outcome_of(lambda: load_checkpoint(root + "-empty", "latest", model, optimizer))
    CheckpointRoot.resolve = real_resolve  # type: ignore[method-assign]
    if rank == 1:
        CheckpointRoot.read_sidecar = no_sidecar  # type: ignore[method-assign]
    args.load = root
    out["megatron_lm_sidecar"] = _outcome_of(lambda: megatron_lm.load_checkpoint(model, optimizer, None, args=args))
    CheckpointRoot.read_sidecar = real_sidecar  # type: ignore[method-assign]
    return out


def test_a_rank_that_fails_before_the_step_is_agreed_is_heard_by_every_rank(tmp_path: Path,
                                                                            module_sockdir: str) -> None:
    root = tmp_path / "root"
    (tmp_path / "root-empty").mkdir()
    results = spawn_with_daemon(_refusals_before_the_step, 2, str(root), os.path.join(module_sockdir, "early.sock"),
                                log_path=str(tmp_path / "early.log"), timeout_s=240)
    zero, one = results
    assert one["missing_here"].startswith("StorageNotFoundError"), one
    assert zero["missing_here"].startswith("StorageNotFoundError: rank 1 refused this load"), zero
    for r in results:
        assert r["missing_everywhere"].startswith("NoCommittedStepError"), r
        assert r["megatron_lm_missing_everywhere"] == "returned (0, 0.0)", r
        assert r["megatron_lm_named_missing"].startswith("StorageNotFoundError"), r
    assert one["nowhere_verdict_fails"].startswith("RuntimeError: CUDA error"), one
    assert zero["nowhere_verdict_fails"].startswith("CkptdError: rank 1 refused this load"), zero
    assert one["open_refused"].startswith("StorageError: HEAD: 503"), one
    assert zero["open_refused"].startswith("StorageError: rank 1 refused this load"), zero
    assert one["none_and_refused"].startswith("StorageError: LIST: 503"), one
    assert zero["none_and_refused"].startswith("StorageError: rank 1 refused this load"), zero  # not "none found"
    assert one["megatron_lm_sidecar"].startswith("CheckpointNotFoundError: sidecar"), one
    assert zero["megatron_lm_sidecar"].startswith("CheckpointNotFoundError: rank 1 refused this load"), zero


def test_only_latest_of_a_local_root_not_made_yet_is_a_root_without_steps(tmp_path: Path) -> None:
    from ckptd.client.megatron.load import _not_made_yet
    from ckptd.writer.backends.local import LocalBackend
    from ckptd.writer.errors import StorageNotFoundError

    def failed_open(path: Path) -> StorageNotFoundError:
        with pytest.raises(StorageNotFoundError) as caught:
            LocalBackend.open(str(path), create=False)
        return caught.value

    missing = failed_open(tmp_path / "nowhere")
    for root in (str(tmp_path / "nowhere"), f"file://{tmp_path}/nowhere", f"FILE://{tmp_path}/nowhere"):
        assert _not_made_yet(root, "latest", missing), root
    (tmp_path / "nowhere").mkdir()  # made meanwhile (a daemon starting): the failed open decides, not a 2nd look
    assert _not_made_yet(str(tmp_path / "nowhere"), "latest", missing)
    assert not _not_made_yet(str(tmp_path / "nowhere"), 100, missing)  # a step named: the missing root is the error
    assert not _not_made_yet("s3://no-such-bucket/run", "latest", missing)  # a bucket that is not there: a typo?
    (tmp_path / "a-file").write_text("")
    assert not _not_made_yet(str(tmp_path / "a-file"), "latest", failed_open(tmp_path / "a-file"))  # not a folder


def _failures_after_the_verdict(rank: int, world: int, socket: str, root: str) -> dict[str, Any]:
    """A read that fails on rank 1 after the verdict let both ranks write (the disk answers EIO), and a rank
    interrupted while it plans (Ctrl-C): both ranks raise, neither waits for the other, and the next load of
    both is whole and bit-exact (the collectives stayed paired)."""
    import errno
    import time

    model, optimizer, train_step = build_gpt(**TINY)
    train_step(1)
    client = CheckpointClient(socket, timeout_s=60)
    save_checkpoint(client, 1, model, optimizer).wait(60)
    client.close()
    saved = [p.detach().clone() for p in model[0].parameters()]
    model2, optimizer2, train_step2 = build_gpt(**TINY, seed=99)
    train_step2(0)
    out: dict[str, Any] = {}
    real_preadv, real_sidecar = os.preadv, CheckpointRoot.read_sidecar

    def failing_disk(fd: int, bufs: Any, pos: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    async def interrupted(self: CheckpointRoot, name: str) -> str:
        raise KeyboardInterrupt

    for case, patch in (("read_fails", lambda: setattr(os, "preadv", failing_disk)),
                        ("interrupted", lambda: setattr(CheckpointRoot, "read_sidecar", interrupted))):
        if rank == 1:
            patch()
        t0 = time.monotonic()
        try:
            out[case] = f"returned {load_checkpoint(root, 'latest', model2, optimizer2).step}"
        except (CkptdError, OSError, KeyboardInterrupt) as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
        out[f"{case}_s"] = time.monotonic() - t0
        os.preadv, CheckpointRoot.read_sidecar = real_preadv, real_sidecar  # type: ignore[method-assign]
    out["again"] = load_checkpoint(root, "latest", model2, optimizer2).step
    out["equal"] = all(torch.equal(a, b) for a, b in zip(saved, model2[0].parameters(), strict=True))
    return out


def test_a_rank_that_fails_after_the_verdict_is_heard_by_every_rank(tmp_path: Path, module_sockdir: str) -> None:
    results = spawn_with_daemon(_failures_after_the_verdict, 2, str(tmp_path / "root"),
                                os.path.join(module_sockdir, "late.sock"), log_path=str(tmp_path / "late.log"),
                                timeout_s=240)
    zero, one = results
    assert "Input/output error" in one["read_fails"], one
    assert zero["read_fails"].startswith(f"{one['read_fails'].split(':')[0]}: rank 1 failed while loading"), results
    assert one["interrupted"] == "KeyboardInterrupt: ", one
    assert zero["interrupted"].startswith("CkptdError: rank 1 refused this load"), zero
    for r in results:
        assert r["read_fails_s"] < 60 and r["interrupted_s"] < 60, r
        assert r["again"] == 1 and r["equal"], r
