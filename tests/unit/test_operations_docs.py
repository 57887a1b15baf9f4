"""The deployment examples of docs/operations.md run command lines the CLI parser accepts."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import yaml

from ckptd.daemon.cli import build_parser

DOC = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()


def _block(lang: str) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", DOC, re.S)
    assert len(blocks) == 1, f"one {lang} example expected, found {len(blocks)}"
    return str(blocks[0])


def _accepted(argv: list[str]) -> None:
    assert argv[0].endswith("ckptd"), argv
    args = build_parser().parse_args(argv[1:])  # SystemExit on an unknown flag or a bad value
    assert args.command == "serve" and args.root


def test_systemd_unit() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.read_string(_block("ini"))
    _accepted(shlex.split(unit["Service"]["ExecStart"]))
    assert int(unit["Service"]["TimeoutStopSec"]) > 120  # longer than the default drain grace


def test_slurm_script() -> None:
    lines = [ln for ln in _block("bash").splitlines() if "ckptd serve" in ln]
    assert len(lines) == 1
    argv = shlex.split(lines[0].rstrip("&").strip())
    _accepted([a.replace("$SLURM_JOB_ID", "123") for a in argv[argv.index("ckptd"):]])
    assert "--ntasks-per-node=1" in argv  # one daemon per node


def test_kubernetes_pod() -> None:
    pod = yaml.safe_load(_block("yaml"))
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    daemon = containers["ckptd"]
    _accepted([*daemon["command"], *daemon["args"]])
    args = build_parser().parse_args([*daemon["command"][1:], *daemon["args"]])
    env = {e["name"]: e["value"] for e in containers["trainer"]["env"]}
    assert env["CKPTD_SOCKET"] == args.socket  # the trainer finds the sidecar's socket
    mounts = [{m["mountPath"] for m in c["volumeMounts"]} for c in (daemon, containers["trainer"])]
    shm = mounts[0] & mounts[1]
    assert "/dev/shm" in shm and args.socket.rsplit("/", 1)[0] in shm
