"""Which model tensors a load may read together with the optimizer's in-place main params: ``covers`` (all of
the tensor's memory is main params: no model read at all) and ``touches`` (any byte is: the model read must
run first, so the main params win)."""

from __future__ import annotations

import torch

from ckptd.client.megatron.targets import SliceTargets


def _targets(buf: torch.Tensor, *ranges: tuple[int, int]) -> SliceTargets:
    t = SliceTargets()
    base, size = buf.data_ptr(), buf.element_size()
    # given out of order, as the loader collects them
    t.main_memory = [(buf.device, base + lo * size, base + hi * size) for lo, hi in reversed(ranges)]
    return t


def test_covers_and_touches_by_address() -> None:
    buf = torch.zeros(1000)
    t = _targets(buf, (100, 200), (300, 400))
    assert t.covers(buf[100:200]) and t.touches(buf[100:200])
    assert t.covers(buf[320:330]) and t.touches(buf[320:330])
    assert not t.covers(buf[50:150]) and t.touches(buf[50:150])  # straddles a range's start
    assert not t.covers(buf[199:301]) and t.touches(buf[199:301])  # both ends inside, a gap between
    assert not t.touches(buf[0:100])  # ends where a range starts
    assert not t.touches(buf[200:300])  # exactly the gap
    assert not t.touches(buf[400:1000])
    assert not t.touches(buf[0:0])


def test_a_strided_tensor_counts_its_whole_span() -> None:
    buf = torch.zeros(1000)
    t = _targets(buf, (300, 400))
    every_other = buf[250:350:2]  # elements 250..348: its span reaches into the range
    assert not t.covers(every_other) and t.touches(every_other)
    columns = buf[:400].view(20, 20)[:, :5]  # rows of 20 elements: 5 of each, the last row at 380..385
    assert t.touches(columns)
    assert not t.touches(buf[:300].view(15, 20)[:, :5])


def test_no_main_params() -> None:
    buf = torch.zeros(100)
    assert not SliceTargets().touches(buf) and not SliceTargets().covers(buf)
