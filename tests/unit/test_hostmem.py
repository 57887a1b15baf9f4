"""A load's new host memory (ckptd.client.hostmem): large tensors are advised to be backed by huge pages
(the kernel records the advice on their mapping: ``hg`` in ``/proc/self/smaps``' VmFlags); small ones,
other devices and every tensor with the advice turned off are not; the tensors are plain torch tensors
either way."""

from __future__ import annotations

import sys

import pytest
import torch

from ckptd.client import hostmem

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or hostmem._MADVISE is None, reason="madvise(MADV_HUGEPAGE) is Linux-only"
)


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _aligned_inside(t: torch.Tensor) -> int:
    """The first huge-page boundary inside ``t``'s memory."""
    return -(-t.data_ptr() // hostmem.HUGE) * hostmem.HUGE


@linux_only
def test_a_large_tensor_is_advised_huge_pages_and_holds_what_is_written() -> None:
    t = hostmem.host_empty(6 * hostmem.HUGE // 4, torch.float32)
    assert t.shape == (6 * hostmem.HUGE // 4,) and t.dtype == torch.float32 and t.device.type == "cpu"
    assert "hg" in _vm_flags(_aligned_inside(t))
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    assert torch.equal(t[-3:], torch.tensor([t.numel() - 3, t.numel() - 2, t.numel() - 1], dtype=torch.float32))


@linux_only
def test_zeros_are_zero_and_advised() -> None:
    z = hostmem.host_zeros(5 * hostmem.HUGE // 2, torch.bfloat16)
    assert z.dtype == torch.bfloat16 and not z.any()
    assert "hg" in _vm_flags(_aligned_inside(z))


@linux_only
def test_small_tensors_and_the_switch_off_are_not_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    small = torch.empty(hostmem.ADVISE_BYTES // 4 - 1, dtype=torch.float32)
    assert not hostmem.advise_huge(small)
    monkeypatch.setattr(hostmem, "enabled", False)
    big = hostmem.host_empty(6 * hostmem.HUGE, torch.uint8)  # (its memory may be reused, advised earlier)
    assert big.numel() == 6 * hostmem.HUGE and not hostmem.advise_huge(big)


def test_other_devices_are_left_alone() -> None:
    meta = torch.empty(6 * hostmem.HUGE, dtype=torch.uint8, device="meta")
    assert not hostmem.advise_huge(meta)
