"""ckptd under verl (>=0.9,<0.10, Megatron engine) with one switch and no fork.

Turn it on in every Ray worker with Ray's setup hook (verl passes ``ray_kwargs.ray_init.runtime_env``
through to ``ray.init``)::

    python -m verl.trainer.main_ppo ... \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=ckptd.integrations.verl.install

:func:`install` replaces verl's ``MegatronCheckpointManager`` (in its defining module and in the Megatron
engine, which builds the manager itself) with :class:`CkptdMegatronCheckpointManager`, a subclass. It
keeps everything verl writes that ckptd does not replace (HF weights and config/tokenizer through verl's
own path, ``transformer_config.json``, ``ckpt_contents.json``, verl's own retention of its folders) and
sends the distributed model, optimizer, LR scheduler and RNG state to ckptd instead of
``dist_checkpointing``: step ``N`` of ``global_step_N``, root ``$CKPTD_ROOT/<role>`` or
``<checkpoint dir>/ckptd/<role>``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import posixpath
import re
import shlex
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from ckptd.client.client import CheckpointClient
from ckptd.client.handle import SaveHandle
from ckptd.client.paths import default_socket_path
from ckptd.client.placement import Placement
from ckptd.client.protocol import StepState
from ckptd.client.storage_env import storage_options_for
from ckptd.writer.errors import CheckpointNotFoundError, CkptdError, InvalidRequestError, StepFailedError
from ckptd.writer.root import open_root
from ckptd.writer.sync import run_sync

log = logging.getLogger(__name__)

ENV_ROOT = "CKPTD_ROOT"  # base of the per-role roots (a path or s3://...); default <checkpoint dir>/ckptd
ENV_DAEMON_ARGS = "CKPTD_DAEMON_ARGS"  # extra `ckptd serve` flags for the embedded daemon
MANIFEST = "ckpt_contents.json"  # verl's contents manifest inside global_step_N/<role>/
FORMAT = "ckptd"  # the "format" verl's manifest gives the pieces ckptd holds
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_VERL_MODULES = (
    "verl.utils.checkpoint.megatron_checkpoint_manager",  # where the class is defined
    "verl.workers.engine.megatron.transformer_impl",  # `self.checkpoint_mananager = MegatronCheckpointManager(...)`
)


# --- where things go ---------------------------------------------------------------------------------
def ckptd_root(local_path: str, role: str, env: Mapping[str, str] = os.environ) -> str:
    """The ckptd root of ``role`` for a save to ``local_path`` (``<ckpt dir>/global_step_N/<role>``):
    ``$CKPTD_ROOT/<role>`` if set, else ``<ckpt dir>/ckptd/<role>``; one root per role, so actor and critic
    (same step numbers) never share one."""
    base = env.get(ENV_ROOT)
    if base:
        return posixpath.join(base.rstrip("/"), role) if "://" in base else os.path.join(os.path.abspath(base), role)
    return os.path.join(_step_folder(local_path)[0], "ckptd", role)


def _step_folder(local_path: str) -> tuple[str, int | None]:
    """The checkpoint dir and step of a save's ``local_path``: ``<dir>/global_step_N/<role>`` (the RL trainer's
    workers), or ``<dir>/global_step_N`` (the SFT trainers' one engine); ``None`` when neither."""
    path = os.path.normpath(os.path.abspath(local_path))
    for folder in (path, os.path.dirname(path)):
        m = _STEP_DIR.match(os.path.basename(folder))
        if m is not None:
            return os.path.dirname(folder), int(m.group(1))
    return os.path.dirname(os.path.dirname(path)), None


def socket_for(root: str, env: Mapping[str, str] = os.environ) -> str:
    """The node daemon's socket for ``root``: the per-root default (:func:`ckptd.client.paths.default_socket_path`),
    so two roots on one node (actor, critic) never share a daemon — ``$CKPTD_SOCKET`` (one socket for the
    process) is ignored here, since both roles run in one worker environment. Start your own ``ckptd serve
    --root ROOT`` per node, or let the first rank of the node start one."""
    return default_socket_path({k: v for k, v in env.items() if k != "CKPTD_SOCKET"}, root)


def step_of(local_path: str) -> int:
    """``N`` of ``.../global_step_N/<role>`` (verl's folder naming): the step a load restores, never
    "latest" (the trainer also takes its step counter and dataloader from that folder)."""
    step = _step_folder(local_path)[1]
    if step is None:
        raise InvalidRequestError(
            f"{local_path}: not a verl checkpoint folder (expected .../global_step_<N>/<role> or .../global_step_<N>)"
        )
    return step


def storage_options(root: str, env: Mapping[str, str] = os.environ) -> dict[str, object]:
    """The S3 options of ``root`` as the daemons the integration starts read them: ``CKPTD_STORAGE_<KEY>``,
    ``$CKPTD_CONFIG``'s ``[storage]`` table and the storage flags in ``$CKPTD_DAEMON_ARGS``
    (:mod:`ckptd.client.storage_env`); the worker's own calls (existence check, retention, load) use them,
    so they reach the endpoint the daemon writes to. ``{}`` for a local root."""
    return storage_options_for(root, env, shlex.split(env.get(ENV_DAEMON_ARGS, "")))


def placement_from_env(env: Mapping[str, str] = os.environ) -> Placement:
    """Ranks under Ray: verl sets ``RANK``, ``WORLD_SIZE`` and ``RAY_LOCAL_WORLD_SIZE`` (not torchrun's
    ``LOCAL_WORLD_SIZE``) and numbers ranks node by node; :meth:`Placement.detect` reads exactly that."""
    return Placement.detect(env)


# --- the switch ----------------------------------------------------------------------------------------
def install() -> None:
    """Make verl build :class:`CkptdMegatronCheckpointManager` wherever it builds its Megatron manager.

    Meant as Ray's ``worker_process_setup_hook`` (runs in every worker before verl's code); calling it
    again is harmless. In a process without megatron-core or verl it warns (saves then stay on verl's
    own path) and does nothing.
    """
    try:
        cls = manager_class()
    except ImportError as exc:  # a worker that does not train with Megatron (or has no verl)
        log.warning("ckptd.integrations.verl: not installed in pid %d, verl's own checkpointing stays (%s)",
                    os.getpid(), exc)
        return
    for name in _VERL_MODULES:
        module = sys.modules.get(name)
        if name == _VERL_MODULES[0] or module is not None:
            # the engine module binds the name at import: patch it if it is already imported, else it
            # picks the patched class up from the defining module when it is imported later
            module = module or __import__(name, fromlist=["_"])
            module.MegatronCheckpointManager = cls  # type: ignore[attr-defined]
    log.info("ckptd.integrations.verl: MegatronCheckpointManager -> ckptd in pid %d", os.getpid())


_CLASS: type | None = None


def manager_class() -> type:
    """:class:`CkptdMegatronCheckpointManager` (built on first use: it subclasses verl's class)."""
    global _CLASS
    if _CLASS is None:
        from verl.utils.checkpoint import megatron_checkpoint_manager as mcm

        base = mcm.MegatronCheckpointManager
        base = getattr(base, "_ckptd_base", base)  # installed twice: subclass verl's class, not ours
        _CLASS = type("CkptdMegatronCheckpointManager", (_CkptdMixin, base), {"_ckptd_base": base})
    return _CLASS


# --- the manager ---------------------------------------------------------------------------------------
class _CkptdMixin:
    """Overrides of verl's ``MegatronCheckpointManager`` (see the module docstring); ``self`` is that class.

    Hooks used (verl 0.9): ``save_checkpoint`` stages the ckptd save first, then runs verl's own save,
    whose ``_build_*_state_dict`` builders return nothing while ckptd saves (so no ``dist_checkpointing``
    tree is built or written, and no optimizer gather happens), and whose ``_dispatch_finalize`` waits for
    the ckptd commit (sync) or defers verl's finalize (async: manifest, tracker, retention) until the
    step committed. ``load_checkpoint`` restores a ckptd step and falls back to verl for its own folders.

    ``save_contents``: ``model`` is what makes a save ckptd's (without it verl's own path runs);
    ``optimizer`` adds the optimizer and LR scheduler, ``extra`` the RNG state; ``hf_model`` (or ``model``
    with ``use_dist_checkpointing: False``) stays verl's HF export. ``load_contents``: see
    :meth:`_ckptd_load_wanted`.
    """

    _ckptd_base: type

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ckptd_client: CheckpointClient | None = None
        self._ckptd_saving: SaveHandle | None = None  # set while verl's save runs inside ours
        self._ckptd_save_root = ""
        self._ckptd_pending: list[tuple[SaveHandle, Callable[[], None]]] = []
        self._ckptd_kept: list[tuple[str, int]] = []  # (root, step) this manager committed, oldest first
        self._ckptd_resumed: list[tuple[str, int]] = []  # the committed steps up to the newest one it loaded
        atexit.register(_finalize_at_exit, weakref.ref(self))

    # --- which saves ckptd takes ---------------------------------------------------------------------
    def ckptd_supported(self) -> str | None:
        """None if ckptd takes this manager's saves, else why verl's own path is kept."""
        v: Any = self
        if v.use_megatron_fsdp:
            return "Megatron FSDP"
        if v.peft_cls is not None:
            return "PEFT adapters"
        if not v.should_save_model:
            return f"save_contents={list(v.checkpoint_save_contents)} has no 'model' (ckptd saves the model shards)"
        if v.should_save_optimizer and (not v.use_distributed_optimizer or v.optimizer is None):
            return "no distributed optimizer"
        from ckptd.client.megatron.introspect import cpu_offloaded

        if v.should_save_optimizer and cpu_offloaded(v.optimizer):
            return "optimizer CPU offload"
        return None

    def _client(self, root: str) -> CheckpointClient:
        if self._ckptd_client is not None and self._ckptd_client.root != root:
            self._ckptd_client.close()
            self._ckptd_client = None
        if self._ckptd_client is None:
            # on_daemon_lost="raise": a step lost with its daemon raises like any failed step (see _committed)
            self._ckptd_client = CheckpointClient(
                socket_for(root), root=root, placement=placement_from_env(), start_daemon=True,
                daemon_args=shlex.split(os.environ.get(ENV_DAEMON_ARGS, "")), storage_options=storage_options(root),
                on_daemon_lost="raise",
            )
        return self._ckptd_client

    # --- save ------------------------------------------------------------------------------------------
    def save_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, max_ckpt_to_keep: int | None = None
    ) -> None:
        v: Any = self
        why = self.ckptd_supported()
        if why is not None:
            log.warning("ckptd: %s: %s; saving with verl's dist_checkpointing", v.role, why)
            v._ckptd_base.save_checkpoint(self, local_path, hdfs_path, global_step, max_ckpt_to_keep)
            return
        self.finalize_pending(blocking=True)  # the previous async save: committed, its tracker written
        root = ckptd_root(local_path, v.role)
        self._drop_abandoned(root, int(global_step))
        extra: dict[str, Any] = {"global_step": int(global_step), "role": v.role}
        if v.lr_scheduler is not None and v.should_save_optimizer:  # verl keeps it with the optimizer
            extra["lr_scheduler"] = v.lr_scheduler.state_dict()
        from ckptd.client.megatron import save_checkpoint

        optimizer = v.optimizer if v.should_save_optimizer else None  # None: the model alone
        handle = save_checkpoint(
            self._client(root), int(global_step), v.model, optimizer, extra=extra, rng=v.should_save_extra
        )
        # verl's own save: HF weights/config/tokenizer, transformer_config.json, then _dispatch_finalize
        self._ckptd_saving, self._ckptd_save_root = handle, root
        try:
            v._ckptd_base.save_checkpoint(self, local_path, hdfs_path, global_step, max_ckpt_to_keep)
        finally:
            self._ckptd_saving = None

    def _drop_abandoned(self, root: str, step: int) -> None:
        """A step being saved again was committed by a run that died before the trainer wrote its tracker
        (the trainer resumed from an older step): verl overwrites its folder, so rank 0 deletes the stale
        ckptd step before anyone stages. Rank 0 then broadcasts how that went (the other ranks wait for it,
        as at a barrier): if it failed, every rank raises, none is left waiting."""
        import torch.distributed as dist

        v: Any = self
        error: Exception | None = None
        failed: list[str | None] = [None]
        if v.rank == 0:
            try:
                if _has_step(root, step, storage_options(root)):
                    log.warning("ckptd: %s: step %d of %s was committed by an earlier run; replacing it",
                                v.role, step, root)
                    run_sync(_delete_step(root, step, storage_options(root)))
            except Exception as exc:  # told to every rank below, then raised here
                error, failed[0] = exc, f"{type(exc).__name__}: {exc}"
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(failed, src=0)
        if error is not None:
            raise error
        if failed[0] is not None:
            raise StepFailedError(f"step {step}: rank 0 could not replace the earlier run's step of {root}: "
                                  f"{failed[0]}")

    def _build_model_sharded_state_dict(self, metadata: dict[str, Any]) -> dict[str, Any]:
        if self._ckptd_saving is not None:
            return {}  # ckptd stages the model; nothing for dist_checkpointing to write
        return super()._build_model_sharded_state_dict(metadata)  # type: ignore[misc,no-any-return]

    def _build_optimizer_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self._ckptd_saving is not None:
            return {}  # no optimizer.sharded_state_dict(): that is the DP gather ckptd exists to avoid
        return super()._build_optimizer_state_dict(*args, **kwargs)  # type: ignore[misc,no-any-return]

    def _build_extra_state_dict(self) -> dict[str, Any]:
        if self._ckptd_saving is not None:
            return {}  # RNG state went with the ckptd save
        return super()._build_extra_state_dict()  # type: ignore[misc,no-any-return]

    def _dispatch_finalize(self, async_requests: list[Any], finalize_save_fn: Callable[[], None]) -> None:
        handle = self._ckptd_saving
        if handle is None:
            super()._dispatch_finalize(async_requests, finalize_save_fn)  # type: ignore[misc]
            return
        if getattr(self, "checkpoint_config", None) is not None and self.checkpoint_config.async_save:  # type: ignore[attr-defined]
            self._ckptd_pending.append((handle, finalize_save_fn))  # tracker once committed
            self.finalize_pending(blocking=False)
        else:
            _committed(handle)  # on every node, else it raises: the trainer writes the tracker when we return
            finalize_save_fn()

    def finalize_pending(self, blocking: bool = False) -> int:
        """Run verl's finalize (manifest, tracker in async mode, retention) for every async save that
        committed; with ``blocking`` wait for them. Called at each save, at exit, and by whoever polls.
        Returns the number finalized. A step that did not commit (failed, or lost with its daemon) raises
        its error once, and verl's finalize (manifest, tracker, retention) never runs for it."""
        done = 0
        while self._ckptd_pending:
            handle, fn = self._ckptd_pending[0]
            if not blocking and not handle.done():
                break
            self._ckptd_pending.pop(0)  # before it may raise: the next call goes on with the next save
            _committed(handle)
            fn()
            done += 1
        return done

    def _finalize_save(self, *, local_path: str, max_ckpt_to_keep: int | None = None, **kw: Any) -> None:
        super()._finalize_save(local_path=local_path, max_ckpt_to_keep=max_ckpt_to_keep, **kw)  # type: ignore[misc]
        v: Any = self
        keep = max_ckpt_to_keep if isinstance(max_ckpt_to_keep, int) else 0
        if v.rank != 0 or keep <= 0 or self.ckptd_supported() is not None:
            return
        # verl's rule (register_checkpoint): the newest ``keep`` of the steps this run saved (and, resumed from
        # the newest step, those up to it: _resumed_from); a step saved after resuming from an older one is
        # never the one deleted
        given = kw.get("global_step")
        saved = (ckptd_root(local_path, v.role), int(given) if isinstance(given, int) else step_of(local_path))
        resumed, self._ckptd_resumed = [k for k in self._ckptd_resumed if k[0] == saved[0]], []
        self._ckptd_kept = [*resumed, *(k for k in self._ckptd_kept if k not in resumed and k != saved), saved]
        for root, step in self._ckptd_kept[:-keep]:
            run_sync(_delete_step(root, step, storage_options(root)))
            self._ckptd_kept.remove((root, step))
            log.info("ckptd: %s: retention removed step %d of %s", v.role, step, root)

    def _build_checkpoint_manifest(
        self, local_path: str, global_step: int, saved_any_dist_ckpt: bool
    ) -> dict[str, Any]:
        manifest: dict[str, Any] = super()._build_checkpoint_manifest(  # type: ignore[misc]
            local_path, global_step, saved_any_dist_ckpt
        )
        if self._ckptd_save_root and self.ckptd_supported() is None:
            v: Any = self
            piece = {"path": self._ckptd_save_root, "format": FORMAT, "step": int(global_step)}
            contents = manifest["contents"]
            if v.should_save_dist_ckpt_model or "model" not in contents:
                contents["model"] = dict(piece)
            else:
                contents["model_shards"] = dict(piece, note="bit-exact training weights; loaded instead of HF")
            if v.should_save_optimizer:
                contents["optimizer"] = dict(piece)
                if v.lr_scheduler is not None:
                    contents["lr_scheduler"] = dict(piece, key="extra.lr_scheduler")
            if v.should_save_extra:
                contents["rng_state"] = dict(piece, key="rng")
            manifest["directories"] = {k: d for k, d in manifest["directories"].items() if "dist_ckpt" not in k}
            manifest["ckptd"] = {"root": self._ckptd_save_root, "step": int(global_step)}
        return manifest

    # --- load ------------------------------------------------------------------------------------------
    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False
    ) -> None:
        v: Any = self
        manifest = _read_manifest(local_path)
        held = manifest.get("ckptd") if manifest else None
        if not held:  # a verl checkpoint (saved without ckptd): verl loads it
            v._ckptd_base.load_checkpoint(self, local_path, hdfs_path, del_local_after_load)
            return
        step = step_of(local_path)
        if int(held["step"]) != step:
            raise InvalidRequestError(f"{local_path}: its {MANIFEST} names ckptd step {held['step']}, not {step}")
        if not self._ckptd_load_wanted(local_path, manifest or {}):
            return  # nothing ckptd holds was asked for (the HF weights, if asked for, are loaded)
        root = ckptd_root(local_path, v.role)
        saved = str(held["root"])
        if _has_step(root, step, storage_options(root)) is False and _has_step(saved, step, storage_options(saved)):
            root = saved  # CKPTD_ROOT changed since the save: use where it went (decided on storage's answers
            # alone, which every rank gets alike: a rank whose storage failed stays on the current root)
        from ckptd.client.megatron import load_checkpoint

        optimizer = v.optimizer if v.should_load_optimizer else None  # None: the model alone
        loaded = load_checkpoint(root, step, v.model, optimizer, rng=v.should_load_extra,
                                 storage_options=storage_options(root))
        if optimizer is None and v.optimizer is not None:  # its fp32 main params would overwrite the loaded
            v.optimizer.reload_model_params()  # weights at the first step (bf16 models)
        extra = loaded.extra if isinstance(loaded.extra, dict) else {}
        if v.should_load_optimizer and v.use_checkpoint_opt_param_scheduler and v.lr_scheduler is not None:
            if "lr_scheduler" not in extra:
                raise CheckpointNotFoundError(f"step {step} of {root} holds no lr_scheduler state")
            v.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        log.info("ckptd: %s: loaded step %d from %s (saved rank %d)", v.role, step, root, loaded.source_rank)
        if v.rank == 0:  # counted as this run's once a save goes to the same root (not another run's root)
            self._ckptd_resumed = _resumed_from(root, step)

    def _ckptd_load_wanted(self, local_path: str, manifest: Mapping[str, Any]) -> bool:
        """Check ``load_contents`` against what the ckptd step holds; False when only the HF weights were
        asked for (loaded here, through verl's bridge). Raises :class:`InvalidRequestError` for what ckptd
        cannot load apart (optimizer or RNG without the model) and :class:`CheckpointNotFoundError` for a
        piece the step does not hold."""
        v: Any = self
        asked = list(v.checkpoint_load_contents)
        if not v.should_load_model:
            if v.should_load_optimizer or v.should_load_extra:
                raise InvalidRequestError(
                    f"load_contents={asked}: a ckptd step restores the optimizer and the RNG state together with "
                    "the model (the optimizer's main params are the model's weights); add 'model'"
                )
            if "hf_model" in asked:  # verl's own HF path (weights written by its bridge at save)
                from verl.utils.megatron_utils import get_hf_model_checkpoint_path

                v._load_model_as_hf_via_bridge(get_hf_model_checkpoint_path(local_path))  # type: ignore[no-untyped-call]
                if v.optimizer is not None:  # as after a model-only load: main params from the loaded weights
                    v.optimizer.reload_model_params()
            return False
        contents = manifest.get("contents", {})
        for wanted, piece, name in ((v.should_load_optimizer, "optimizer", "optimizer"),
                                    (v.should_load_extra, "rng_state", "extra")):
            if wanted and contents.get(piece, {}).get("format") != FORMAT:
                raise CheckpointNotFoundError(
                    f"{local_path}: its ckptd step holds no {piece} (saved with save_contents="
                    f"{manifest.get('save_contents')}); drop {name!r} from load_contents={asked}"
                )
        return True


def _committed(handle: SaveHandle) -> None:
    """Wait until ``handle``'s step committed on every node; raise why it did not (its error: a failed
    step, its daemon lost). Only then may verl's finalize (manifest, tracker, retention) run for it."""
    handle.wait()  # raises a failed step's error (the client's on_daemon_lost="raise": a lost daemon too)
    if handle.state is not StepState.COMMITTED:  # lost under another policy, or skipped: never committed
        raise handle.exception() or StepFailedError(f"step {handle.step} did not commit ({handle.state})")


def _finalize_at_exit(ref: weakref.ref[Any]) -> None:
    manager = ref()
    if manager is not None:
        try:
            manager.finalize_pending(blocking=True)  # async mode: the last save's tracker
        except Exception:  # at exit there is no caller left to raise to
            log.exception("ckptd: the last checkpoint did not commit; its tracker was not written")


def _read_manifest(local_path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(local_path, MANIFEST)) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    return doc if isinstance(doc, dict) else None


def _resumed_from(root: str, step: int) -> list[tuple[str, int]]:
    """The steps retention counts as this run's after a load of ``step``: where it is the newest committed
    step (a resume after preemption), the committed steps up to it, so that each resume does not leave
    ``max_ckpt_to_keep`` more behind; none where newer steps exist (a resume from an older step: they are
    another branch's, never deleted for being newer) or storage did not answer."""
    async def run() -> list[int]:
        async with open_root(root, storage_options(root)) as ckpt:
            return await ckpt.committed_steps()

    try:
        committed = run_sync(run())
    except (CkptdError, OSError):
        return []
    return [(root, s) for s in committed] if committed and committed[-1] == step else []


def _has_step(root: str, step: int, options: Mapping[str, object]) -> bool | None:
    """Whether ``step`` is committed under ``root``: False for a root that is not there, None when storage did
    not answer (the load that follows meets the failure again, and tells every rank: a rank that raised here
    instead would leave the others waiting in the load's agreement)."""
    async def run() -> bool:
        async with open_root(root, options) as ckpt:
            return await ckpt.is_committed(step)

    try:
        return run_sync(run())
    except (CheckpointNotFoundError, FileNotFoundError):  # StorageNotFoundError too: no such root
        return False
    except (CkptdError, OSError):
        return None


async def _delete_step(root: str, step: int, options: Mapping[str, object]) -> None:
    from ckptd.writer.commit import CheckpointWriter

    async with open_root(root, options) as ckpt:
        await CheckpointWriter(ckpt.backend).delete_step(step)

