"""``load_checkpoint``: restore model, optimizer and RNG state in place, from the DP or the merged layout.

One async core (:func:`load_checkpoint_async`) reads everything through one opened
:class:`~ckptd.writer.root.CheckpointRoot`; the sync :func:`load_checkpoint` opens the store once
(:func:`~ckptd.writer.root.open_root`), runs the core and closes the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from ckptd.client.collector import paused
from ckptd.client.fastread import ChunkReader
from ckptd.client.megatron import introspect
from ckptd.client.megatron.agree import LoadAgreement, tell_rollback
from ckptd.client.megatron.checks import (
    Record,
    check_no_extra_keys,
    check_parallel_sizes,
    check_structure,
    saved_metas,
    saved_records,
    uniform_scalars,
)
from ckptd.client.megatron.layout import get_layout, saved_layouts
from ckptd.client.megatron.model import model_template
from ckptd.client.megatron.optimizer import apply_optimizer_state, check_optimizer_meta, drop_unsaved_state
from ckptd.client.megatron.rank_state import RankState, plan_rank_state
from ckptd.client.megatron.reshard import plan_dp_slices, plan_merged_slices, saved_states
from ckptd.client.megatron.targets import SliceTargets, main_dtype, optimizer_regions, slice_regions, slice_targets
from ckptd.client.megatron.vocab import VocabFit, fit_vocab
from ckptd.client.reader import plan_reads
from ckptd.client.restore import ArenaSource, arena_source
from ckptd.client.state import Shard
from ckptd.writer.errors import (
    CheckpointNotFoundError,
    CkptdError,
    LayoutMismatchError,
    NoCommittedStepError,
    StateMismatchError,
    StorageNotFoundError,
)
from ckptd.writer.format import (
    LAYOUT_FIELD,
    MODEL_PREFIX,
    OPTIM_META,
    CommitManifest,
)
from ckptd.writer.layout import MegatronLayout, decode_layout
from ckptd.writer.merge import merged_states
from ckptd.writer.root import CheckpointRoot, open_root
from ckptd.writer.sync import run_sync
from ckptd.writer.urls import is_local

if TYPE_CHECKING:
    from ckptd.client.client import CheckpointClient
    from ckptd.client.megatron.introspect import MegatronOptimizer

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored besides the tensors it filled in place."""

    step: int
    extra: object  # the ``extra`` plain data given to save_checkpoint (None if there was none)
    source_rank: int  # the saved rank whose RNG state and ``extra`` were restored
    from_memory_bytes: int = 0  # bytes copied from the daemon's arena (in-memory restore), checksummed
    # where the optimizer state was read: "saved" (each rank's own stored bucket slices, the saving run's
    # TP/PP and buckets), "merged" (the per-parameter layout `ckptd merge` built), "resharded" (the stored DP
    # bucket slices read through the layout sidecars, no merge), "model" (no optimizer loaded)
    layout: Literal["saved", "merged", "resharded", "model"] = "saved"


@paused
def load_checkpoint(
    root_or_client: str | CheckpointClient,
    step: int | str,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    *,
    strict: bool = True,
    rng: bool = True,
    storage_options: Mapping[str, object] | None = None,
) -> LoadedCheckpoint:
    """Restore model, optimizer and RNG state saved by ``save_checkpoint``, in place, on every rank.

    ``root_or_client`` is the checkpoint root (path or URL) or a ``CheckpointClient``; ``step`` an int,
    ``"latest"``, or a step's name (``"step_100"``, Megatron-LM's ``"iter_0000100"``). Any TP/PP/DP and
    any grad-buffer bucket layout loads: with the saving run's TP/PP and buckets each rank reads its own
    slice of every stored bucket (clipped to the stored padding when DP changed); otherwise each param's
    optimizer state is read from the merged layout when ``ckptd merge`` built one, else straight from the
    stored DP bucket slices through the saved layout sidecars (no merge needed). The store is opened once
    for the whole load and closed before returning. Under an initialized process group every rank of it
    calls this: the ranks agree on the step (the highest any resolved) and, before the first write, on
    whether all can load it; one rank's refusal is raised on every rank (:mod:`~ckptd.client.megatron.agree`).

    Everything is checked before any live tensor is written: a model key missing from the checkpoint,
    another global shape or dtype, a param no saved state covers, or (``strict``, same layout) a
    checkpoint key the model lacks raises :class:`StateMismatchError` naming it; but another padded vocabulary
    (the first axis of a tensor marked ``allow_shape_mismatch``) loads as Megatron's loader does it
    (:mod:`ckptd.client.megatron.vocab`). Model params come from
    the model arrays; the optimizer's fp32 main params and states from the bucket slices. RNG state
    (``rng``), ``_extra_state`` and ``extra`` come from this rank's saved counterpart, on every path
    (:mod:`ckptd.client.megatron.rank_state`): the saved rank with this rank's TP/PP/DP coordinates in a run
    of the same TP/PP sizes (DP rank 0 of them when that DP rank did not exist); after a TP/PP size change
    there is none, and RNG and ``_extra_state`` are left as they are (one warning).
    """
    root, opts = _root_of(root_or_client, storage_options)

    client = None if isinstance(root_or_client, str) else root_or_client
    together = LoadAgreement()  # here, in the caller's thread: its CUDA device is the rank's

    async def run() -> LoadedCheckpoint:
        loaded: LoadedCheckpoint | None = None
        try:
            async with open_root(root, opts) as ckpt:
                loaded = await load_checkpoint_async(ckpt, step, model_chunks, optimizer, strict=strict, rng=rng,
                                                     client=client, together=together)
        except Exception as exc:
            if loaded is not None:  # every rank loaded (agreed); only closing the store failed, here
                logger.warning("step %d loaded; closing its storage afterwards failed: %s", loaded.step, exc)
                return loaded
            # "latest" of a local root not made yet is a root without steps (Megatron-LM starts from scratch on
            # it); a step named, or a bucket that does not exist (a typo?), is the error it is
            if isinstance(exc, StorageNotFoundError) and not together.stepped and _not_made_yet(root, step, exc):
                try:
                    nowhere = together.step(None) is None
                    if nowhere:
                        together.verdict(last=True)
                except BaseException as failed:  # before its all-reduce: refuse() makes it
                    together.refuse(failed)
                    raise
                if nowhere:
                    raise NoCommittedStepError(f"no committed checkpoint under {root}: it does not exist") from exc
            together.refuse(exc)  # the store could not be opened on this rank: the others must hear it
            raise
        except BaseException as exc:  # interrupted: the others must hear it too
            together.refuse(exc)
            raise
        return loaded

    return run_sync(run())


def _not_made_yet(root: str, step: int | str, exc: StorageNotFoundError) -> bool:
    """Whether ``exc`` says that ``root``, a local folder, does not exist (decided by the failed open itself,
    not by a second look a daemon making the folder meanwhile could change), and ``step`` is ``"latest"``."""
    return step == "latest" and is_local(root) and isinstance(exc.__cause__, FileNotFoundError)


def _root_of(
    root_or_client: str | CheckpointClient, storage_options: Mapping[str, object] | None
) -> tuple[str, Mapping[str, object] | None]:
    if isinstance(root_or_client, str):
        return root_or_client, storage_options
    return str(root_or_client.root), storage_options or root_or_client.storage_options


async def load_checkpoint_async(
    ckpt: CheckpointRoot,
    step: int | str,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    *,
    strict: bool = True,
    rng: bool = True,
    client: CheckpointClient | None = None,
    together: LoadAgreement | None = None,
) -> LoadedCheckpoint:
    """:func:`load_checkpoint` on an opened root (every read goes through ``ckpt``; it is not closed).

    With ``client``, a same-layout load first asks its daemon for the step's shards kept in memory
    (in-memory restore, :mod:`ckptd.client.restore`) and reads the rest from storage. Under an initialized
    process group every rank of it loads together: they agree on the step, and before the first write on
    whether every rank can load it (:mod:`~ckptd.client.megatron.agree`; ``together``: the agreement begun
    by the caller, made here otherwise)."""
    together = together or LoadAgreement()
    try:
        loaded = await _load(ckpt, step, model_chunks, optimizer, strict=strict, rng=rng, client=client,
                             together=together)
        together.done()  # every rank finished, or each raises the failed rank's error
    except BaseException as exc:  # interrupted too: the ranks waiting on this one learn it will not load
        together.refuse(exc)  # (no-op where every rank ended alike, or done()'s all-reduce was made)
        raise
    return loaded


async def _load(
    ckpt: CheckpointRoot,
    step: int | str,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer | None,
    *,
    strict: bool,
    rng: bool,
    client: CheckpointClient | None,
    together: LoadAgreement,
) -> LoadedCheckpoint:
    missing: CheckpointNotFoundError | None = None
    try:
        resolved: int | None = await ckpt.resolve(step)  # N, "latest", "step_N" or "iter_NNNNNNN"
    except CheckpointNotFoundError as exc:  # none here; another rank may have found one (a commit just landed)
        resolved, missing = None, exc
    agreed = together.step(resolved)
    if agreed is None:  # no rank found one: unless a rank refused for another reason (its error goes first)
        together.verdict(last=True)
        raise missing or NoCommittedStepError(f"no committed checkpoint for {step!r}")
    commit = await ckpt.read_commit(agreed)
    if step != "latest" and together.first:
        await tell_rollback(ckpt, agreed)
    records = saved_records(commit)
    if optimizer is None:
        return await _load_model_only(ckpt, commit, records, model_chunks, strict=strict, rng=rng,
                                      together=together)
    with introspect.leaves_reused():  # the layout and the model template walk the model's sharded_state_dict() once
        layout = get_layout(model_chunks, optimizer)
        template, vocab = fit_vocab(commit, model_template(model_chunks), model_chunks)  # another padded vocab
    same_mp = {r: rec for r, rec in records.items() if (rec["tp"], rec["pp"]) == (layout.tp_rank, layout.pp_rank)}
    reason: CkptdError | None = None
    try:
        check_parallel_sizes(commit.step, records, layout)
        if not same_mp:
            raise LayoutMismatchError(
                f"step {commit.step} holds no rank with TP rank {layout.tp_rank} and PP rank {layout.pp_rank}"
            )
    except LayoutMismatchError as exc:
        reason = exc
    if reason is None:
        source = next((r for r, rec in sorted(same_mp.items()) if rec["dp"] == layout.dp_rank), min(same_mp))
        if not records[source][LAYOUT_FIELD]:
            raise _saved_without_optimizer(commit.step)
        saved_layout = decode_layout(await ckpt.read_sidecar(records[source][LAYOUT_FIELD]))
        # 1. check everything (pure), so a mismatch leaves the live model and optimizer untouched
        plan_reads(commit, template)
        if strict:
            check_no_extra_keys(commit, saved_layout, template)
        try:
            check_structure(saved_layout, layout)
        except StateMismatchError as exc:
            reason = exc
    if reason is not None:
        # another TP/PP, or other buckets at the same TP/PP: the merged layout when present, else the saved
        # DP bucket slices read through the layout sidecars (no merge needed)
        if not any(rec[LAYOUT_FIELD] for rec in records.values()):
            raise _saved_without_optimizer(commit.step)
        logger.info("step %d: params sit elsewhere than at save time (%s); resharding on read", commit.step, reason)
        manifest = await ckpt.read_merged_manifest(commit.step, source=commit)
        if manifest is not None:
            return await _load_merged(ckpt, commit, manifest, records, template, model_chunks, optimizer, layout,
                                      rng=rng, vocab=vocab, together=together)
        return await _load_resharded(ckpt, commit, records, template, model_chunks, optimizer, layout, rng=rng,
                                     vocab=vocab, together=together)

    regions, dtypes = optimizer_regions(commit, layout, optimizer)
    # at the saved layout each rank restores its own saved rank's scalar state (Adam's step...); at another DP
    # size every rank takes the one value all saved ranks hold, as on every path to another layout
    at_saved = (records[source]["dp"], records[source]["dp_size"]) == (layout.dp_rank, layout.dp_size)
    metas = [commit.objects[str(source)][OPTIM_META] if at_saved
             else uniform_scalars(commit.step, saved_metas(commit, records), source)]
    check_optimizer_meta(optimizer, layout, metas)
    rank = plan_rank_state(commit, records, model_chunks, _coords(layout), rng=rng)
    memory = arena_source(client, commit.step) if client is not None else None
    # separate live main params (bf16 model) are read into one by one, from storage (the arena copy takes
    # whole slices)
    targets = slice_targets(optimizer, layout, regions, dtypes, parts=memory is None)

    # 2. the model and RNG buffers in place, then the optimizer slices straight into the optimizer's tensors
    # where they lie as stored (else into new flat state tensors, or fresh ones to copy from). A model param
    # that lies inside this rank's main params (fp32: both are views of the grad buffer) is left to the
    # optimizer's read, which comes second so the main params win where they share memory with the model, as
    # after Megatron's own load. What the node's daemon still holds of this step comes from its arena
    # (checked against the manifest).
    def optimizer_reads(reader: ChunkReader) -> None:
        for key in targets.slices:
            targets.add_reads(reader, key, regions[key][0])

    await _fill_model(ckpt, commit, {**template, **rank.rng}, targets, memory, agreed=together.verdict,
                      then=optimizer_reads, zero=vocab.zero)
    targets.install()
    slices: dict[str, Any] = dict(targets.slices)
    slices[OPTIM_META] = metas
    drop_unsaved_state(optimizer, layout, slices)
    apply_optimizer_state(optimizer, layout, slices, copy_to_model=False, in_place=targets.in_place)
    rank.restore(model_chunks, rng=rng)
    logger.info(
        "loaded step %d (tp%d pp%d dp%d/%d, saved at DP %d)",
        commit.step, layout.tp_rank, layout.pp_rank, layout.dp_rank, layout.dp_size, records[source]["dp_size"],
    )
    if memory is not None:
        logger.info("step %d: %d bytes restored from the daemon's memory (%d regions fell back to storage)",
                    commit.step, memory.served_bytes, len(memory.rejected))
    return LoadedCheckpoint(commit.step, rank.extra, rank.source,
                            memory.served_bytes if memory is not None else 0)


async def _fill_model(
    ckpt: CheckpointRoot,
    commit: CommitManifest,
    template: Mapping[str, Any],
    targets: SliceTargets,
    memory: ArenaSource | None = None,
    *,
    agreed: Callable[[], None],
    then: Callable[[ChunkReader], None] | None = None,
    zero: Callable[[], None] | None = None,
) -> None:
    """Read the template's tensors in place, except where this rank's in-place main params hold them (an
    fp32 model's params share the grad buffer with them): the optimizer's read writes those. ``then`` adds
    that read to the same pass. Of a model tensor that the main params hold in part (a param across a DP
    slice's edge) only the rest is read (:meth:`~.targets.SliceTargets.outside`), in the same pass; where
    that cannot be split (an odd view) it is read whole, first, on its own, so the main params win where they
    share memory. The parts are not staged shards, so an in-memory restore reads them from storage while the
    main params come from the arena: each rank reads the rest of such a param, not all of it a second time
    under the arena's copy. Every read is added, and so checked, before the first is made, and before ``zero``
    (:meth:`~.vocab.VocabFit.zero`), the load's first write; ``agreed`` comes between (the ranks' verdict,
    :meth:`~.agree.LoadAgreement.verdict`)."""
    shards = [sh for sh in plan_reads(commit, template) if not targets.covers(sh.data)]
    first, rest = ChunkReader(ckpt, commit, memory=memory), ChunkReader(ckpt, commit, memory=memory)
    for sh in shards:  # every read is added (and checked) before any is made
        touches = targets.touches(sh.data)
        parts = targets.outside(sh.data) if touches else None
        if parts is not None:
            for sel, part in parts:
                offset = tuple(o + x.start for o, x in zip(sh.global_offset, sel, strict=True))
                (first if then is None else rest).add(sh.key, part, offset)
            continue
        (first if then is None or touches else rest).add(sh.key, sh.data, sh.global_offset)
    if then is not None:
        then(rest)
    agreed()
    if zero is not None:
        zero()
    await first.run()
    await rest.run()


async def _load_merged(
    ckpt: CheckpointRoot,
    commit: CommitManifest,
    manifest: CommitManifest,
    records: Mapping[int, Record],
    template: Mapping[str, Shard],
    model_chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    layout: MegatronLayout,
    *,
    rng: bool,
    vocab: VocabFit,
    together: LoadAgreement,
) -> LoadedCheckpoint:
    """Load a step saved with another TP/PP or bucket layout from its merged (fully reshardable) layout.

    Model tensors are in model space already, so each rank reads its new regions of them; the optimizer
    state of each of this rank's buckets is rebuilt from the per-parameter merged arrays. Plain optimizer
    data (param groups, grad scaler) comes from the saved rank :func:`~.rank_state.plan_rank_state` picks;
    scalar state such as Adam's step must be one value over every saved rank
    (:func:`~.checks.uniform_scalars`). RNG state and ``_extra_state`` as on every path
    (:mod:`~ckptd.client.megatron.rank_state`): from this rank's saved counterpart, which exists when the
    TP/PP sizes are unchanged.
    """
    plan_reads(commit, template)  # every model key and shape checked before anything is written
    rank = plan_rank_state(commit, records, model_chunks, _coords(layout), rng=rng)
    states = main_dtype(commit.step, merged_states(manifest), optimizer, layout)
    targets = slice_targets(optimizer, layout, *slice_regions(layout, states))
    fitted = vocab.fit(layout)  # the model pieces cut to the checkpoint's vocabulary rows, if they differ
    planned = plan_merged_slices(commit.step, manifest, fitted, targets.slices, cut=vocab.cut)  # checked first
    metas = [uniform_scalars(commit.step, saved_metas(commit, records), rank.source)]
    check_optimizer_meta(optimizer, layout, metas)
    merged = ChunkReader(ckpt, manifest)
    planned.add_to(merged)
    await _fill_model(ckpt, commit, {**template, **rank.rng}, targets, agreed=together.verdict,
                      zero=lambda: vocab.zero(planned.slices))
    await merged.run()  # second: the main params win where they share memory with the model (fp32)
    slices: dict[str, Any] = dict(planned.finish())
    targets.install()
    slices[OPTIM_META] = metas
    return _apply(commit, records, rank, model_chunks, optimizer, layout, slices, rng=rng, source="merged",
                  in_place=targets.in_place)


_SOURCES = {"merged": "its merged layout", "resharded": "its DP layout without a merge"}


def _apply(
    commit: CommitManifest,
    records: Mapping[int, Record],
    rank: RankState,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    layout: MegatronLayout,
    slices: dict[str, Any],
    *,
    rng: bool,
    source: Literal["merged", "resharded"],
    in_place: Collection[str] = (),
) -> LoadedCheckpoint:
    """The common end of the two loads at another layout (model tensors and RNG already read into place):
    the optimizer's state applied from ``slices`` (``in_place``: keys already written into the optimizer's
    tensors), per-rank state restored, one log line."""
    drop_unsaved_state(optimizer, layout, slices)
    apply_optimizer_state(optimizer, layout, slices, copy_to_model=False, in_place=in_place)
    rank.restore(model_chunks, rng=rng)
    saved = records[rank.source]
    logger.info(
        "loaded step %d from %s (saved TP=%d PP=%d DP=%d; now tp%d pp%d dp%d of TP=%d PP=%d DP=%d)",
        commit.step, _SOURCES[source], saved["tp_size"], saved["pp_size"], saved["dp_size"], layout.tp_rank,
        layout.pp_rank, layout.dp_rank, layout.tp_size, layout.pp_size, layout.dp_size,
    )
    return LoadedCheckpoint(commit.step, rank.extra, rank.source, layout=source)


async def _load_resharded(
    ckpt: CheckpointRoot,
    commit: CommitManifest,
    records: Mapping[int, Record],
    template: Mapping[str, Shard],
    model_chunks: Sequence[torch.nn.Module],
    optimizer: MegatronOptimizer,
    layout: MegatronLayout,
    *,
    rng: bool,
    vocab: VocabFit,
    together: LoadAgreement,
) -> LoadedCheckpoint:
    """Load into another parallel or bucket layout straight from the stored DP bucket slices.

    One layout sidecar per saved model-parallel rank says where each saved param's state sits in the
    stored buckets and where its pieces sit in model space (:func:`~.reshard.plan_dp_slices`). The model's
    tensors and the optimizer's states are read in one pass, as on the same-layout path. Plain optimizer
    data, RNG state and ``_extra_state`` as in :func:`_load_merged`.
    """
    plan_reads(commit, template)
    rank = plan_rank_state(commit, records, model_chunks, _coords(layout), rng=rng)
    saved = await saved_layouts(ckpt, commit, records)
    # into the optimizer's memory where it can
    states = main_dtype(commit.step, saved_states(commit, saved), optimizer, layout)
    targets = slice_targets(optimizer, layout, *slice_regions(layout, states))
    fitted = vocab.fit(layout)  # the model pieces cut to the checkpoint's vocabulary rows, if they differ
    planned = plan_dp_slices(commit, saved, fitted, targets.slices, cut=vocab.cut)  # checked before any write
    metas = [uniform_scalars(commit.step, saved_metas(commit, records), rank.source)]
    check_optimizer_meta(optimizer, layout, metas)
    # the model, but not where the main params share its memory (fp32): the optimizer's read fills that
    await _fill_model(ckpt, commit, {**template, **rank.rng}, targets, agreed=together.verdict,
                      then=planned.add_to, zero=lambda: vocab.zero(planned.slices))
    slices: dict[str, Any] = dict(planned.finish())
    targets.install()
    slices[OPTIM_META] = metas
    return _apply(commit, records, rank, model_chunks, optimizer, layout, slices, rng=rng, source="resharded",
                  in_place=targets.in_place)


async def _load_model_only(
    ckpt: CheckpointRoot,
    commit: CommitManifest,
    records: Mapping[int, Record],
    model_chunks: Sequence[torch.nn.Module],
    *,
    strict: bool,
    rng: bool,
    together: LoadAgreement,
) -> LoadedCheckpoint:
    """The model alone (finetune, ``--no-load-optim``): model tensors are in model space, so any TP/PP/DP
    loads them. RNG, ``_extra_state`` and ``extra`` as on every path (:mod:`~ckptd.client.megatron.rank_state`)."""
    ranks = introspect.parallel_ranks()
    template, vocab = fit_vocab(commit, model_template(model_chunks), model_chunks, with_optimizer=False)
    plan_reads(commit, template)  # every model key, shape and dtype checked before anything is written
    if strict and ranks.pp_size == 1 and all(rec["pp_size"] == 1 for rec in records.values()):
        have = {sh.key for sh in template.values()}
        extra = sorted(r.name for r in commit.arrays if r.name.startswith(MODEL_PREFIX) and r.name not in have)
        if extra:
            raise StateMismatchError(
                f"{extra[0]}: in checkpoint step {commit.step} but not in the model (and {len(extra) - 1} more); "
                "pass strict=False to ignore checkpoint keys the model lacks"
            )
    coords = (ranks.tp_rank, ranks.pp_rank, ranks.tp_size, ranks.pp_size, ranks.dp_rank)
    rank = plan_rank_state(commit, records, model_chunks, coords, rng=rng)
    await _fill_model(ckpt, commit, {**template, **rank.rng}, SliceTargets(), agreed=together.verdict,
                      zero=vocab.zero)
    rank.restore(model_chunks, rng=rng)
    logger.info("loaded the model of step %d (tp%d pp%d dp%d), no optimizer state", commit.step, ranks.tp_rank,
                ranks.pp_rank, ranks.dp_rank)
    return LoadedCheckpoint(commit.step, rank.extra, rank.source, layout="model")


def _saved_without_optimizer(step: int) -> StateMismatchError:
    return StateMismatchError(f"step {step} was saved without optimizer state: load it with optimizer=None "
                              "(no_load_optim)")


def _coords(layout: MegatronLayout) -> tuple[int, int, int, int, int]:
    """(tp, pp, tp_size, pp_size, dp) of the live rank, as :func:`plan_rank_state` takes them."""
    return layout.tp_rank, layout.pp_rank, layout.tp_size, layout.pp_size, layout.dp_rank
