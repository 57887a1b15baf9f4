"""Which job a process belongs to, and which process owns the job's embedded daemon on this node.

An embedded daemon (:mod:`ckptd.client.embedded`) is started with ``--job-id`` and ``--owner-pid``; its
``Welcome`` carries both. A client of another job that meets it on its socket refuses it
(:class:`~ckptd.writer.errors.JobMismatchError`), or, when that daemon is going away (draining, or its
owner is dead), waits for it to exit and starts its own (:class:`~ckptd.writer.errors.StaleDaemonError`).
A daemon without a job id (``ckptd serve`` run by an operator) serves any job.

The job id, first match wins: ``CKPTD_JOB_ID`` (set it when ranks of one job are started by unrelated
processes), ``TORCHELASTIC_RUN_ID`` (torchrun; its ``"none"`` default does not count), ``SLURM_JOB_ID``,
``RAY_JOB_ID`` (Ray sets it in every worker of a job), else the owner process: ``pid:<pid>@<start time>``.

The owner is the process whose end is the job's end on this node: the launcher that started the rank
(torchrun's agent, ``slurmstepd``, the parent of spawned ranks) — so the daemon outlives a crash and
restart of the ranks and can serve an in-memory restore — or the process itself when it has no launcher
(no ``RANK``/``LOCAL_RANK``/``SLURM_PROCID``), when its parent is Ray's raylet (which outlives every
job) or when it was orphaned.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ckptd.writer.errors import JobMismatchError, StaleDaemonError

_JOB_VARS = (("TORCHELASTIC_RUN_ID", "torchelastic"), ("SLURM_JOB_ID", "slurm"), ("RAY_JOB_ID", "ray"))
_LAUNCHED_VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID")


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat``), or None if it is gone.

    With the pid it names one process for the machine's uptime: a pid reused later has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime 22
    return int(fields[19]) if len(fields) > 19 else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def owner_pid(env: Mapping[str, str]) -> int:
    """The process whose end is this job's end on this node (see the module docstring)."""
    me, parent = os.getpid(), os.getppid()
    if not any(v in env for v in _LAUNCHED_VARS) or parent <= 1 or env.get("RAY_RAYLET_PID") == str(parent):
        return me
    return parent


def job_identity(env: Mapping[str, str]) -> str:
    """This process's job id (see the module docstring); every rank of a job on a node gets the same."""
    if env.get("CKPTD_JOB_ID"):
        return env["CKPTD_JOB_ID"]
    for var, kind in _JOB_VARS:
        value = env.get(var, "")
        if value and value != "none":
            return f"{kind}:{value}"
    pid = owner_pid(env)
    return f"pid:{pid}@{process_start_time(pid) or 0}"


def check_daemon_job(
    mine: str, theirs: str, *, daemon_pid: int, owner: int, draining: bool, socket_path: str
) -> None:
    """Refuse a daemon of another job: nothing if it has no job id or ours; else
    :class:`StaleDaemonError` when it is going away (draining, or its owner is dead), else
    :class:`JobMismatchError`. Both name the two jobs."""
    if not theirs or theirs == mine:
        return
    where = f"the daemon at {socket_path} (pid {daemon_pid}) belongs to job {theirs!r}, this client to job {mine!r}"
    if draining or (owner > 0 and not pid_alive(owner)):
        raise StaleDaemonError(f"{where}; that job is over and its daemon is exiting", daemon_pid=daemon_pid)
    raise JobMismatchError(
        f"{where}, which is still running: a daemon is never shared between jobs. Use another root, stop "
        "that job, or set the same CKPTD_JOB_ID in both if they are one job"
    )
