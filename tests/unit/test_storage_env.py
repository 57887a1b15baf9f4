"""A rank reads the S3 options the node daemon reads: ``ckptd.client.storage_env`` against the daemon's own
loader (``ckptd.daemon.config``, which the client package may not import), and the integrations using it."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

import pytest

from ckptd.client.storage_env import storage_options_for, storage_options_from_env
from ckptd.daemon.cli import _storage_flag_values, build_parser
from ckptd.daemon.config import load_config
from ckptd.integrations.verl import storage_options
from ckptd.writer.errors import ConfigError, NoCommittedStepError

ROOT = "s3://bucket/run1/actor"


def _daemons(env: dict[str, str], daemon_args: str) -> dict[str, object]:
    """The storage options ``ckptd serve --root ROOT <daemon_args>`` runs with in ``env``."""
    args = build_parser().parse_args(["serve", "--root", ROOT, *shlex.split(daemon_args)])
    return load_config({"root": ROOT, "storage": _storage_flag_values(args)}, env, args.config).storage_options


CASES = [
    ({}, ""),
    ({"CKPTD_STORAGE_ENDPOINT_URL": "http://minio:9000", "CKPTD_STORAGE_ADDRESSING_STYLE": "path",
      "ckptd_storage_region": "eu-1", "CKPTD_STORAGE_MAX_ATTEMPTS": "3", "CKPTD_STORAGE_CONNECT_TIMEOUT": "2.5",
      "CKPTD_STORAGE_CONDITIONAL_PUT": "no", "CKPTD_STORAGE_ANONYMOUS": "1", "CKPTD_ARENA_SIZE": "1GiB"}, ""),
    ({"CKPTD_STORAGE": '{"endpoint_url": "http://json:1", "fs_retries": 2}',
      "CKPTD_STORAGE_ENDPOINT_URL": "http://env:2"}, ""),
    ({"CKPTD_CONFIG": "{config}", "CKPTD_STORAGE_REGION": "from-env"}, ""),
    ({"CKPTD_STORAGE_ENDPOINT_URL": "http://env:2", "CKPTD_STORAGE_REGION": "from-env"},
     "--arena-size 64MiB --endpoint-url http://flag:3 --max-attempts=4 --no-prefault --storage-option "
     "conditional_put=false --storage-option multipart-concurrency=2 --config {config}"),
]


@pytest.mark.parametrize(("env", "daemon_args"), CASES)
def test_the_same_options_as_the_daemon(env: dict[str, str], daemon_args: str, tmp_path: Path) -> None:
    config = tmp_path / "ckptd.toml"
    config.write_text('[daemon]\narena_size = "1GiB"\n[storage]\nendpoint-url = "http://file:4"\n'
                      'region = "from-file"\nread_timeout = 30.0\nrequest_checksums = "when_required"\n'
                      'max_attempts = "8"\nanonymous = "yes"\n')  # text the daemon's settings convert
    env = {k: v.replace("{config}", str(config)) for k, v in env.items()}
    daemon_args = daemon_args.replace("{config}", str(config))
    ours = storage_options_from_env(env, shlex.split(daemon_args))
    assert ours == _daemons(env, daemon_args)
    if env or daemon_args:
        assert ours  # every case but the first gives some


def test_local_roots_take_none_and_read_nothing() -> None:
    bad = {"CKPTD_STORAGE_MAX_ATTEMPTS": "many", "CKPTD_CONFIG": "/no/such/file.toml"}
    assert storage_options_for("/ckpt/run1/actor", bad) == {} == storage_options_for("file:///ckpt", bad)
    with pytest.raises(ConfigError):
        storage_options_for(ROOT, bad)
    with pytest.raises(ConfigError, match="unknown S3 options"):
        storage_options_from_env({"CKPTD_STORAGE_ENDPOINT": "http://typo"})


def test_verl_reads_the_embedded_daemons_flags_too() -> None:
    env = {"CKPTD_DAEMON_ARGS": "--arena-size 64GiB --endpoint-url http://minio:9000 --addressing-style path",
           "CKPTD_STORAGE_REGION": "eu-1"}
    assert storage_options(ROOT, env) == {"endpoint_url": "http://minio:9000", "addressing_style": "path",
                                          "region": "eu-1"}
    assert storage_options("/local/actor", env) == {}


def test_megatron_lm_adapter_uses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own client (the tracker on S3 goes through ``client.storage_options``) and its loads."""
    pytest.importorskip("torch")
    import ckptd.client.client as client_module
    import ckptd.client.megatron.load as load_module
    from ckptd.client.megatron import megatron_lm

    monkeypatch.setenv("CKPTD_STORAGE_ENDPOINT_URL", "http://minio:9000")
    monkeypatch.setenv("CKPTD_STORAGE_MAX_ATTEMPTS", "2")
    expected = {"endpoint_url": "http://minio:9000", "max_attempts": 2}
    made: list[dict[str, Any]] = []

    class FakeClient:
        def __init__(self, *a: Any, **kw: Any) -> None:
            made.append(kw)

    monkeypatch.setattr(client_module, "CheckpointClient", FakeClient)
    session = megatron_lm._session(argparse.Namespace(save=ROOT), {}, None)
    assert made[0]["storage_options"] == expected and session.save_dir == ROOT

    loads: list[tuple[str, object, object]] = []

    def fake_load(root: str, step: object, *a: Any, storage_options: object = None, **kw: Any) -> Any:
        loads.append((root, step, storage_options))
        raise NoCommittedStepError("nothing there")  # (0, 0): training from scratch

    monkeypatch.setattr(load_module, "load_checkpoint", fake_load)
    args = argparse.Namespace(load=f"{ROOT}/iter_0000004", finetune=False, no_load_optim=False)
    assert megatron_lm.load_checkpoint([], None, None, args=args) == (0, 0.0)
    megatron_lm.load_checkpoint([], None, None, args=args, storage_options={"region": "given"})
    assert loads == [(ROOT, 4, expected), (ROOT, 4, {"region": "given"})]
