"""A client's policy options are checked where it is made: a typo is a ``ConfigError``, not another policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.client import CheckpointClient
from ckptd.client.placement import Placement
from ckptd.writer.errors import ConfigError


@pytest.mark.parametrize(("option", "value"), [("backpressure", "skp"), ("on_daemon_lost", "ignore")])
def test_an_unknown_policy_is_refused_before_connecting(option: str, value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{option} must be one of .*{value!r}"):
        CheckpointClient(str(tmp_path / "none.sock"), placement=Placement(0, 1, 1, 0), **{option: value})
