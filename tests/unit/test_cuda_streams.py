"""The CUDA calls around the staging arena, recorded on a CPU machine through stand-ins for torch.cuda's
runtime entry points (no GPU here; the ``gpu``-marked tests run the real ones): a staged copy waits for the
current stream of every device its sources are on, not only the current device's (a D2H copy is queued on its
source's device's stream, which is not the current device's where a rank never set it); the page-locked
arena is unregistered before it is unmapped, so a later mapping at the same address is registered anew."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import plan as plan_mod
from ckptd.client import staging as staging_mod
from ckptd.client.plan import sync_streams


class _Stream:
    def __init__(self, log: list[Any], device: Any) -> None:
        self.log, self.device = log, device

    def synchronize(self) -> None:
        self.log.append(("sync", self.device))


def test_the_streams_of_every_source_device_are_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[Any] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(log, device))
    sync_streams((torch.device("cuda", 2), torch.device("cuda", 0), torch.device("cuda", 3)))
    assert log == [("sync", 0), ("sync", torch.device("cuda", 2)), ("sync", torch.device("cuda", 3))]
    log.clear()
    sync_streams()  # a plan made before the devices were known: the current device's stream, as before
    assert log == [("sync", 0)]
    assert plan_mod.StagePlan.__dataclass_fields__["devices"].default == ()


class _Runtime:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.registered: set[int] = set()

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr))
        if ptr in self.registered:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        self.registered.discard(ptr)
        return 0


def test_the_arena_is_unregistered_before_it_is_unmapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    path = tmp_path / "arena"
    path.write_bytes(bytes(1 << 16))
    path.chmod(0o600)  # a daemon's arena: private to its user, as the client requires
    arena = staging_mod.StagingArena()
    for _ in range(2):  # a daemon restarted: the arena mapped again, maybe at the same address
        arena.map(str(path), 1 << 16)
        arena._bytes(cuda=True)
        arena._bytes(cuda=True)  # once per mapping
    arena.close()
    kinds = [k for k, _ in runtime.calls]
    assert kinds == ["register", "unregister", "register", "unregister"], runtime.calls
    assert not runtime.registered
    refusing = _Runtime()  # a registration refused (warned; copies stay pageable): nothing to undo at close
    monkeypatch.setattr(refusing, "cudaHostRegister", lambda ptr, size, flags: 1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: refusing)
    arena.map(str(path), 1 << 16)
    arena._bytes(cuda=True)
    arena.close()
    assert refusing.calls == []
