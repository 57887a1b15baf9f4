"""The deployment examples of docs/operations.md run command lines the CLI parser accepts."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import msgspec
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
    assert "/dev/shm" in shm
    # the socket's folder is a subfolder of a shared volume, which the daemon creates (its own, 0700): the
    # volume's own folder belongs to root (0777), which a daemon of another uid refuses (prepare_socket_dir)
    folder = args.socket.rsplit("/", 1)[0]
    assert folder not in shm and any(folder.startswith(m + "/") for m in shm), (folder, shm)


def test_status_example_is_what_status_prints() -> None:
    """The ``ckptd status`` example is format_report's output for the report it shows (every line, in order)."""
    from ckptd.client.protocol import PROTOCOL_VERSION, StatusReport, StepReport, StepState
    from ckptd.daemon.commands import format_report

    (block,) = [b for b in re.findall(r"```console\n(.*?)```", DOC, re.S) if "$ ckptd status" in b]
    shown = "\n".join(ln for ln in block.splitlines() if not ln.startswith("$ "))
    mib = 1 << 20
    steps = [StepReport(step=5300, state=StepState.PENDING, node=0, ranks_saved=8, local_world_size=8,
                        nbytes=1600 * mib, age_s=3.1),
             StepReport(step=5200, state=StepState.COMMITTED, node=0, ranks_saved=8, local_world_size=8,
                        nbytes=1600 * mib, age_s=212.4)]
    report = StatusReport(
        v=PROTOCOL_VERSION, daemon_pid=41733, root="s3://bucket/run7", uptime_s=5214, draining=False,
        arena_bytes=16384 * mib, arena_free_bytes=12736 * mib, leases=10, in_flight=1, steps=steps, commits=52,
        failures=1, bytes_written=83200 * mib, bytes_per_s=1480 * mib, retries=17,
        last_error="step 4100: StorageFullError: /ckpt: no space left (ENOSPC)", arena_retained_bytes=1600 * mib,
        job_id="slurm:8812", owner_pid=41700, socket="/run/user/1000/ckptd/daemon.sock", arena_ahead_bytes=1600 * mib,
        metrics_url="http://127.0.0.1:9464/metrics",
    )
    printed = [ln.rstrip() for ln in format_report(report, "/elsewhere.sock").splitlines()]  # empty error column
    assert printed == shown.splitlines()
    without = format_report(msgspec.structs.replace(report, metrics_url=""), "/elsewhere.sock").splitlines()
    assert "metrics  off (--metrics-port)" in without
