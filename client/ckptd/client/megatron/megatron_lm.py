"""Megatron-LM's two checkpoint calls with their signatures, backed by ckptd (see docs/megatron.md).

``megatron/training/training.py`` calls ``save_checkpoint(iteration, model, optimizer,
opt_param_scheduler, num_floating_point_operations_so_far, checkpointing_context, ...)`` and
``iteration, num_floating_point_operations_so_far = load_checkpoint(model, optimizer,
opt_param_scheduler, load_arg='load', strict=True, ...)``; importing these two names from here instead
of ``megatron.training.checkpointing`` is the whole change. What Megatron-LM's ``generate_state_dict``
saves besides tensors is saved as plain data in each rank's ``extra["megatron_lm"]``:
``checkpoint_version``, ``iteration``, ``opt_param_scheduler.state_dict()``,
``num_floating_point_operations_so_far``, the data position (``consumed_train_samples``,
``skipped_train_samples``, ``consumed_valid_samples``), the rerun state machine's state when it has one,
and (rank 0) ``args`` as a plain dict. The ckptd step number is the iteration. After the step committed,
rank 0 writes Megatron-LM's tracker ``<args.save>/latest_checkpointed_iteration.txt``: at once with a
synchronous save, or from :func:`finalize_async_saves` with ``--async-save`` (Megatron-LM's
``maybe_finalize_async_save``); never for a step that did not commit (a failed step raises, one lost with
its daemon only warns under the client's default ``on_daemon_lost="warn"``). S3 options: the client's,
else those the node daemon reads (``CKPTD_STORAGE_<KEY>``, ``$CKPTD_CONFIG``; see
:mod:`ckptd.client.storage_env`). ``args`` is Megatron-LM's ``get_args()`` namespace; pass ``args=`` to
avoid the global. Megatron-LM's step names are read wherever a step is given (``--load
<root>/iter_0000100``, ``--ckpt-step iter_0000100``: :func:`resolve_load`); storage keeps ckptd's
``step_100`` (:func:`ckptd.writer.format.parse_step` reads both).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptd.writer.errors import CkptdError, ConfigError, NoCommittedStepError
from ckptd.writer.format import CONTROL_DIR, parse_step, split_step_path

if TYPE_CHECKING:
    import torch

    from ckptd.client.client import CheckpointClient
    from ckptd.client.handle import SaveHandle

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker file, in args.save
CHECKPOINT_VERSION = 3.0  # what Megatron-LM's generate_state_dict writes as checkpoint_version
RECORD = "megatron_lm"  # the key in save_checkpoint's ``extra``
_CONTEXT_KEY = "ckptd"
_DEFAULT_CONTEXT: dict[str, Any] = {}  # used when the caller passes no checkpointing_context


@dataclass
class _Session:
    """What one training run keeps between saves (in ``checkpointing_context["ckptd"]``)."""

    client: CheckpointClient
    save_dir: str
    pending: list[tuple[int, SaveHandle]] = field(default_factory=list)
    tracked: int | None = None


def _get_args(args: argparse.Namespace | None) -> argparse.Namespace:
    if args is not None:
        return args
    from megatron.training import get_args  # Megatron-LM itself, when the caller runs inside it

    return get_args()  # type: ignore[no-any-return]


def _flag(args: argparse.Namespace, name: str) -> bool:
    return bool(getattr(args, name, False))


def plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """``vars(args)`` as plain data: numbers, strings, bools, None, lists and dicts; anything else by ``str``."""

    def plain(v: object) -> object:
        if v is None or isinstance(v, bool | int | float | str):
            return v
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        return str(v)  # torch.dtype, enums, paths, ...

    return {k: plain(v) for k, v in sorted(vars(args).items())}


def _session(
    args: argparse.Namespace, context: MutableMapping[str, Any] | None, client: CheckpointClient | None
) -> _Session:
    ctx = _DEFAULT_CONTEXT if context is None else context
    session = ctx.get(_CONTEXT_KEY)
    if isinstance(session, _Session) and (client is None or session.client is client):
        return session
    if client is None:
        from ckptd.client.client import CheckpointClient
        from ckptd.client.storage_env import storage_options_for

        # the per-root default socket: a `ckptd serve --root <args.save>` on the node, else an embedded one;
        # the daemon's S3 options, for the tracker (write_tracker) and loads through this client
        client = CheckpointClient(root=args.save, start_daemon=getattr(args, "ckptd_start_daemon", True),
                                  storage_options=storage_options_for(str(args.save)))
    session = _Session(client, str(args.save))
    ctx[_CONTEXT_KEY] = session
    _DEFAULT_CONTEXT[_CONTEXT_KEY] = session  # maybe_finalize_async_save() is called without the context
    return session


def save_checkpoint(
    iteration: int,
    model: Sequence[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float,
    checkpointing_context: MutableMapping[str, Any] | None = None,
    *,
    args: argparse.Namespace | None = None,
    client: CheckpointClient | None = None,
    train_data_iterator: object = None,
    **kwargs: object,
) -> SaveHandle:
    """Megatron-LM's ``save_checkpoint``: stage everything of ``iteration`` with ckptd; ckptd step = iteration.

    Without ``args.async_save`` it returns once the step committed and the tracker file is written (like
    Megatron-LM's synchronous save); with it, as soon as the data is staged, and
    :func:`finalize_async_saves` writes the tracker later. ``args.no_save_optim`` saves the model alone,
    ``args.no_save_rng`` skips RNG, ``args.ckpt_assume_constant_structure`` saves under that promise
    (``assume_constant_structure`` of :func:`ckptd.client.megatron.save_checkpoint`). Megatron-LM's other
    keyword arguments (``pipeline_rank``, ...) are accepted and ignored: ckptd's layout does not depend on
    them; ``args.non_persistent_save_interval`` is a :class:`ConfigError` (:func:`_refuse_unsupported`).
    """
    from ckptd.client.megatron.save import save_checkpoint as ckptd_save

    args = _get_args(args)
    _refuse_unsupported(args)
    session = _session(args, checkpointing_context, client)
    finalize_async_saves(checkpointing_context=checkpointing_context)  # earlier saves: errors and tracker first
    rank = session.client.placement.rank
    record = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": int(iteration),
        "opt_param_scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
        "num_floating_point_operations_so_far": float(num_floating_point_operations_so_far),
        "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
        "skipped_train_samples": int(getattr(args, "skipped_train_samples", 0) or 0),
        "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
        "rerun_state_machine": _rerun_state(train_data_iterator),
        "args": plain_args(args) if rank == 0 else None,  # once, not once per rank: it is ~1k entries
    }
    if kwargs:
        logger.debug("rank %d: Megatron-LM save arguments ignored by ckptd: %s", rank, sorted(kwargs))
    handle = ckptd_save(
        session.client, int(iteration), list(model), None if _flag(args, "no_save_optim") else optimizer,
        extra={RECORD: record}, rng=not _flag(args, "no_save_rng"),
        assume_constant_structure=True if _flag(args, "ckpt_assume_constant_structure") else None,
    )
    session.pending.append((int(iteration), handle))
    if not _flag(args, "async_save"):
        finalize_async_saves(blocking=True, checkpointing_context=checkpointing_context)
    return handle


def finalize_async_saves(
    blocking: bool = False, terminate: bool = False, checkpointing_context: MutableMapping[str, Any] | None = None
) -> None:
    """Megatron-LM's ``maybe_finalize_async_save(blocking, terminate)``: for saves that committed, write the
    tracker (rank 0).

    ``blocking`` waits for every pending save (Megatron-LM calls it before the next save and, with
    ``terminate=True``, at exit; ckptd needs no worker to terminate); otherwise only what already finished
    is handled. A save that failed raises its error here (once). A save lost with its daemon raises only
    under the client's ``on_daemon_lost="raise"``; under the default ``"warn"`` training goes on with a
    warning. Either way no tracker names a step that did not commit. Without ``checkpointing_context`` it
    finalizes the saves of the last context used.
    """
    from ckptd.client.protocol import StepState

    ctx = _DEFAULT_CONTEXT if checkpointing_context is None else checkpointing_context
    session = ctx.get(_CONTEXT_KEY)
    if not isinstance(session, _Session):
        return
    while session.pending:
        iteration, handle = session.pending[0]
        if not blocking and not handle.done():
            return
        session.pending.pop(0)  # before it may raise: the next call goes on with the next save
        handle.wait()  # raises the error of a failed save (a lost daemon: per the client's on_daemon_lost)
        if handle.state is not StepState.COMMITTED:
            logger.warning("iteration %d did not commit (%s: %s); %s is not written for it", iteration,
                           handle.state, handle.exception(), TRACKER)
            continue
        if session.client.placement.rank == 0 and (session.tracked is None or iteration > session.tracked):
            write_tracker(session.save_dir, iteration, session.client.storage_options)
            session.tracked = iteration


def write_tracker(save_dir: str, iteration: int, storage_options: Mapping[str, object] | None = None) -> None:
    """``<save_dir>/latest_checkpointed_iteration.txt`` = ``iteration`` (atomically on a local disk)."""
    data = str(int(iteration)).encode()
    if "://" not in save_dir or save_dir.startswith("file://"):
        path = os.path.join(save_dir.removeprefix("file://"), TRACKER)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
        return
    from ckptd.writer.backends import open_backend
    from ckptd.writer.sync import run_sync

    async def put() -> None:
        async with await open_backend(save_dir, dict(storage_options or {})) as backend:
            await backend.put(TRACKER, data)

    run_sync(put())


def read_tracker(load_dir: str) -> int | None:
    """The iteration in a local ``latest_checkpointed_iteration.txt``, or None if there is none."""
    try:
        with open(os.path.join(load_dir, TRACKER)) as fh:
            return int(fh.read().strip())
    except FileNotFoundError:
        return None


def _rerun_state(train_data_iterator: object) -> object:
    """The rerun state machine's state as plain data: None unless a step is being re-run."""
    try:
        from megatron.core.rerun_state_machine import get_rerun_state_machine
    except ImportError:
        return None
    state = get_rerun_state_machine().state_dict(train_data_iterator, "torch_dist")
    if state is None:
        return None
    from ckptd.client.protocol import encode_objects

    try:
        encode_objects({"s": state})
    except (CkptdError, TypeError, ValueError):  # its rank-level part is a ShardedObject: say so, save the rest
        logger.warning("the rerun state machine's state is not plain data; ckptd does not save it")
        return None
    return state


def load_checkpoint(
    model: Sequence[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    load_arg: str = "load",
    strict: bool = True,
    checkpointing_context: MutableMapping[str, Any] | None = None,
    skip_load_to_model_and_opt: bool = False,
    *,
    args: argparse.Namespace | None = None,
    storage_options: Mapping[str, object] | None = None,
    **kwargs: object,
) -> tuple[int, float]:
    """Megatron-LM's ``load_checkpoint``: returns ``(iteration, num_floating_point_operations_so_far)``.

    Loads the newest committed step of ``getattr(args, load_arg)``, or ``args.ckpt_step``, or the step
    the path names (``<root>/iter_0000100``, see :func:`resolve_load`), through ``storage_options`` (default:
    the S3 options the node daemon reads, :mod:`ckptd.client.storage_env`); ``(0, 0)`` when there is none
    (an error with ``args.exit_on_missing_checkpoint``). Sets ``args.consumed_train_samples``,
    ``skipped_train_samples`` and ``consumed_valid_samples`` and the scheduler's state. ``args.finetune``
    loads the model alone and starts at iteration 0 with the data position at 0; ``args.no_load_optim``
    skips optimizer and scheduler; ``args.no_load_rng`` (or finetune) skips RNG. The optimizer's
    main params are re-copied from the model when its state is not loaded (``reload_model_params``).
    Where ``--load`` is unset or holds no committed step, ``args.pretrained_checkpoint`` (a ckptd root) is
    loaded as with ``--finetune``, as Megatron-LM does; a missing one is an error.
    ``skip_load_to_model_and_opt`` (torch FSDP2) is a :class:`ConfigError`.
    """
    from ckptd.client.megatron.load import load_checkpoint as ckptd_load

    args = _get_args(args)
    _refuse_unsupported(args)
    if skip_load_to_model_and_opt:  # Megatron-LM's torch FSDP2 path: it would still load iteration and data
        raise ConfigError("skip_load_to_model_and_opt (--use-torch-fsdp2): ckptd loads Megatron DDP models only")
    load_dir = getattr(args, load_arg, None)
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if not load_dir and not pretrained:
        return 0, 0.0
    finetune = _flag(args, "finetune")
    loaded = None
    ckpt_step = getattr(args, "ckpt_step", None)
    if load_dir:
        load_dir, step = resolve_load(str(load_dir), ckpt_step)
        loaded = _load_from(ckptd_load, load_dir, step, model, optimizer, args, strict, finetune, storage_options,
                            missing_ok=bool(pretrained) or not _flag(args, "exit_on_missing_checkpoint"),
                            no_root_ok=bool(pretrained))
    if loaded is None and pretrained:  # Megatron-LM's fallback: fine-tune from --pretrained-checkpoint
        load_dir, step = resolve_load(_ckptd_root(str(pretrained)), ckpt_step)
        finetune = args.finetune = True
        loaded = _load_from(ckptd_load, load_dir, step, model, optimizer, args, strict, finetune, storage_options,
                            missing_ok=False)
    if loaded is None:
        logger.warning("no committed checkpoint under %s: training from scratch", load_dir)
        return 0, 0.0
    load_optim = optimizer is not None and not finetune and not _flag(args, "no_load_optim")
    if optimizer is not None and not load_optim:
        optimizer.reload_model_params()  # the fp32 main params must start from the loaded weights
    extra = loaded.extra if isinstance(loaded.extra, Mapping) else {}
    found = extra.get(RECORD)
    record: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    flops = float(record.get("num_floating_point_operations_so_far", 0.0))
    if finetune:
        _set_loaded_iteration(int(record.get("iteration", loaded.step)))
        return 0, flops
    args.consumed_train_samples = int(record.get("consumed_train_samples", 0))
    args.skipped_train_samples = int(record.get("skipped_train_samples", 0))
    args.consumed_valid_samples = int(record.get("consumed_valid_samples", 0))
    _update_num_microbatches(args.consumed_train_samples)
    if load_optim and opt_param_scheduler is not None and record.get("opt_param_scheduler") is not None:
        opt_param_scheduler.load_state_dict(dict(record["opt_param_scheduler"]))
    if record.get("rerun_state_machine") is not None:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        get_rerun_state_machine().load_state_dict(record["rerun_state_machine"])
    iteration = int(record.get("iteration", loaded.step))
    _set_loaded_iteration(iteration)
    logger.info("loaded iteration %d from %s (consumed samples %d)", iteration, load_dir, args.consumed_train_samples)
    return iteration, flops


def _load_from(
    ckptd_load: Any, load_dir: str, step: int | str, model: Sequence[torch.nn.Module], optimizer: Any,
    args: argparse.Namespace, strict: bool, finetune: bool, storage_options: Mapping[str, object] | None,
    missing_ok: bool, no_root_ok: bool = False,
) -> Any:
    """One load of ``step`` of ``load_dir`` (the optimizer unless fine-tuning or ``--no-load-optim``); None
    when nothing is committed there and ``missing_ok`` (or, with ``no_root_ok``, there is no root at all)."""
    if storage_options is None:
        from ckptd.client.storage_env import storage_options_for

        storage_options = storage_options_for(load_dir)
    load_optim = optimizer is not None and not finetune and not _flag(args, "no_load_optim")
    local = load_dir.removeprefix("file://")
    if no_root_ok and "://" not in local and not os.path.lexists(local):  # a local root not made yet
        return None
    try:
        return ckptd_load(
            load_dir, step, list(model), optimizer if load_optim else None, strict=strict,
            rng=not (finetune or _flag(args, "no_load_rng")), storage_options=storage_options,
        )
    except NoCommittedStepError:  # nothing committed (or no local root yet); a bucket that is not there raises
        if not missing_ok:
            raise
        return None


def _ckptd_root(path: str) -> str:
    """``path``, refused by name where it is a local Megatron-LM checkpoint (its tracker file, no ckptd root's
    documents) given as ``--pretrained-checkpoint``: ckptd reads its own format only."""
    local = path.removeprefix("file://")
    if "://" not in local and os.path.exists(os.path.join(local, TRACKER)) and not any(
        os.path.exists(os.path.join(local, name)) for name in (CONTROL_DIR, "zarr.json")  # any ckptd format
    ):
        raise ConfigError(f"--pretrained-checkpoint {path} is not a ckptd root (a Megatron-LM checkpoint?): ckptd "
                          "loads its own format; load it with Megatron-LM once and save it with ckptd")
    return path


def _refuse_unsupported(args: argparse.Namespace) -> None:
    """Megatron-LM options whose checkpoints ckptd does not make, refused when the adapter is first used (the
    load at startup, or the first save) rather than silently made permanent hours into the run."""
    if getattr(args, "non_persistent_save_interval", None):
        raise ConfigError(
            "--non-persistent-save-interval: ckptd keeps no separate non-persistent checkpoints (each would become "
            "a permanent step of --save and move its tracker); a ckptd save stalls for a copy only, so save with "
            "--save-interval as often as you would have saved non-persistently"
        )


def resolve_load(load_dir: str, ckpt_step: object = None) -> tuple[str, int | str]:
    """Where Megatron-LM's ``--load`` and ``--ckpt-step`` point: ``(root, step)``.

    ``--load <root>`` loads ``ckpt_step`` if given, else the newest committed step (``"latest"``);
    ``--load <root>/iter_0000100`` (Megatron-LM's folder of one iteration; ``step_100`` too) loads step 100
    of ``<root>``, unless ``<root>/iter_0000100`` is itself a ckptd root on a local disk. ``ckpt_step`` is
    a number or a name (``"iter_0000100"``); one that contradicts the step in the path is a
    :class:`ConfigError`.
    """
    root, named = split_step_path(load_dir)
    local = load_dir.removeprefix("file://")
    if named is not None and "://" not in local and os.path.exists(os.path.join(local, CONTROL_DIR)):
        root, named = load_dir, None  # a root that happens to be called iter_N
    wanted = None if ckpt_step is None or ckpt_step == "" else parse_step(str(ckpt_step))
    if named is not None and wanted is not None and wanted != named:
        raise ConfigError(f"--load {load_dir} names step {named} but --ckpt-step is {ckpt_step}")
    if named is not None:
        return root, named
    return root, "latest" if wanted is None else wanted


def _set_loaded_iteration(iteration: int) -> None:
    """As Megatron-LM's load does: ``training.py`` reads it back with ``get_loaded_iteration()``."""
    try:
        from megatron.training.checkpointing import set_loaded_iteration
    except ImportError:  # megatron-core alone (Megatron-LM is not installed)
        return
    set_loaded_iteration(iteration)


def _update_num_microbatches(consumed_samples: int) -> None:
    """As Megatron-LM's load does: a batch-size ramp-up continues from the loaded data position."""
    try:
        from megatron.core import num_microbatches_calculator as calc
    except ImportError:
        return
    if calc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:  # set up by Megatron-LM's initialize
        calc.update_num_microbatches(consumed_samples=consumed_samples, verbose=True)


def checkpoint_args(root: str, step: int | str = "latest", storage_options: Mapping[str, object] | None = None
                    ) -> dict[str, Any]:
    """The saving run's ``args`` (plain dict, from rank 0), e.g. for Megatron-LM's ``--use-checkpoint-args``.

    ``root`` and ``step`` as :func:`resolve_load` reads them (``step``: a number, ``"iter_0000100"``...)."""
    from ckptd.client.reader import read_commit

    root, which = resolve_load(root, None if step == "latest" else step)  # <root>/iter_0000100 works too
    commit = read_commit(root, parse_step(which), storage_options=storage_options)
    extra = commit.objects.get("0", {}).get("extra") or {}
    return dict((extra.get(RECORD) or {}).get("args") or {})
