"""Progress of long work (ckptd.writer.progress): a tqdm bar on a terminal, log lines elsewhere (none for work
shorter than the interval). A load's reader and ``verify_array`` reporting every byte: test_fastread.py."""

from __future__ import annotations

import io
import logging
import threading

import pytest

from ckptd.writer.progress import ByteProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_at_most_every_interval_and_one_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ckptd.writer.progress")
    quiet = ByteProgress("short", 100, out=io.StringIO(), every_s=3600)  # not a terminal: no bar
    quiet.advance(100)
    quiet.close()
    assert quiet.bar is None and caplog.records == []  # work shorter than the interval logs nothing

    each = ByteProgress("merge of step 7", 4 << 20, every_s=0.0)
    each.advance(1 << 20, "bucket0")
    each.expect(4 << 20)  # planned in rounds: the total grows
    each.advance(3 << 20, "bucket1")
    each.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("merge of step 7: bucket0, 25.0% (1 of 4 MiB")
    assert lines[1].startswith("merge of step 7: bucket1, 50.0% (4 of 8 MiB")
    assert lines[2].startswith("merge of step 7: finished, 50.0%") and len(lines) == 3

    failed = ByteProgress("load of step 7", 1 << 20, every_s=0.0)
    failed.advance(1 << 19)
    failed.close(done=False)
    assert caplog.records[-1].getMessage().startswith("load of step 7: stopped, 50.0%")


def test_a_terminal_gets_a_bar_and_threads_count_every_byte() -> None:
    out = Terminal()
    bar = ByteProgress("verify step 3", 8 * 1000 * 4096, out=out)
    threads = [threading.Thread(target=lambda: [bar.advance(4096) for _ in range(1000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    assert bar.done == bar.total and "verify step 3" in out.getvalue() and "100%" in out.getvalue()
