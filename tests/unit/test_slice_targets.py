"""Which model tensors a load may read together with the optimizer's in-place main params: ``covers`` (all of
the tensor's memory is main params: no model read at all), ``touches`` (any byte is) and ``outside`` (the
boxes of a touched tensor that no main param holds: only those are read, together with the main params)."""

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


def test_outside_is_exactly_the_elements_no_main_param_holds() -> None:
    buf = torch.arange(1000, dtype=torch.float32)
    # main params of neighbouring params back to back (one merged range), and one further on
    t = _targets(buf, (130, 150), (150, 173), (290, 300))
    w = buf[100:300].view(10, 20)  # a (10, 20) model param cut mid-row at 130, 173 and 290
    parts = t.outside(w)
    assert parts is not None
    got = sorted(int(x) for _sel, part in parts for x in part.reshape(-1))
    assert got == [*range(100, 130), *range(173, 290)]
    for sel, part in parts:  # each a box of the param: a view of it, in place
        assert len(sel) == 2 and part.data_ptr() == w[sel].data_ptr() and part.shape == w[sel].shape
        assert not t.touches(part)
    whole = t.outside(buf[400:500].view(5, 20))  # no main param there: one box, all of it
    assert whole is not None and [sel for sel, _part in whole] == [(slice(0, 5), slice(0, 20))]
    assert t.outside(buf[:400].view(20, 20)[:, :5].t()) is None  # not in memory order: read whole, first
