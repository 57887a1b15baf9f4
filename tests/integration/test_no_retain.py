"""The switch that turns the in-memory restore off (``ckptd serve --no-retain``, ``retain = false``,
``CKPTD_RETAIN=false``): the daemon frees every slot once written, answers a restore request with nothing
held, ``ckptd status`` says so, and a load reads storage. A daemon with the default keeps the step (the
control)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptd.client import CheckpointClient, Placement
from ckptd.client.protocol import PROTOCOL_VERSION, RestoreReply, RestoreRequest
from ckptd.client.reader import load
from ckptd.client.restore import arena_source
from ckptd.daemon.config import load_config

pytestmark = pytest.mark.timeout(120)


def _status(socket: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "ckptd.daemon.cli", "status", "--socket", socket, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report: dict[str, object] = json.loads(out.stdout)
    return report


def test_retain_is_configured_like_every_option(tmp_path: Path) -> None:
    assert load_config({"root": "r"}, {}).retain is True
    assert load_config({"root": "r"}, {"CKPTD_RETAIN": "false"}).retain is False
    toml = tmp_path / "c.toml"
    toml.write_text('root = "r"\nretain = false\n')
    assert load_config({}, {}, str(toml)).retain is False
    assert load_config({"retain": True}, {}, str(toml)).retain is True  # the flag wins over the file


@pytest.mark.parametrize("retain", [False, True])
def test_no_retain_answers_not_held_and_the_load_reads_storage(start_daemon, tmp_path, retain: bool) -> None:
    root = str(tmp_path / "ckpt")
    d = start_daemon(root, "d0", *([] if retain else ["--no-retain"]), arena="16MiB")
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    try:
        data = torch.randn(1 << 18)
        client.save(1, {"x": data}).wait(30)
        reply = client._request(RestoreRequest(v=PROTOCOL_VERSION, step=1))
        assert isinstance(reply, RestoreReply)
        source = arena_source(client, 1)
        report = _status(d.socket)
        text = subprocess.run([sys.executable, "-m", "ckptd.daemon.cli", "status", "--socket", d.socket],
                              capture_output=True, text=True, timeout=60, env=os.environ).stdout
        out = torch.zeros(1 << 18)
        load(root, 1, {"x": out})
        assert torch.equal(out, data)
    finally:
        client.close()
    if retain:  # the control: the default keeps the step and says so
        assert len(reply.shards) == 1 and source is not None and report["retain"] is True
        assert report["arena_retained_bytes"] == 1 << 20 and "in-memory restore on, 1 MiB" in text
    else:
        assert reply.shards == [] and source is None  # not held: the load reads storage
        assert report["retain"] is False and report["arena_retained_bytes"] == 0
        assert report["arena_free_bytes"] == report["arena_bytes"]  # every slot freed once written
        assert "in-memory restore off (--no-retain)" in text
