"""A tiny, bit-reproducible Megatron GPT for tests and demos, plus a gloo rank launcher.

Test/demo code only: the ckptd library never imports it. :func:`build_gpt` builds a real megatron-core
``GPTModel`` (local layer spec, SwiGLU MLP, CPU initialization) wrapped in
``DistributedDataParallel(use_distributed_optimizer=True)`` with Megatron's ``DistributedOptimizer``;
:func:`spawn_ranks` runs a function in ``world_size`` real processes joined by a gloo process group
(through :func:`ckptd.testing.launch.run_ranks`, the one launcher).

Determinism: the data of global micro-batch ``j`` at iteration ``i`` comes from a generator seeded with
``(data_seed, i, j)`` only, and the loss a step reports is the mean of the per-micro-batch losses
gathered over DP in global micro-batch order. The number of global micro-batches is fixed, so the loss
reported for a given set of parameters is bit-identical whatever the DP size.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ckptd.testing.launch import DaemonProcess, RankFailedError, free_port, run_ranks

__all__ = ["RankFailedError", "ToyGPT", "build_gpt", "free_port", "spawn_ranks", "spawn_with_daemon"]


class ToyGPT(NamedTuple):
    """What :func:`build_gpt` returns; unpacks as ``model, optimizer, train_step``."""

    model: list[torch.nn.Module]
    optimizer: Any  # what get_megatron_optimizer returns (a ChainedOptimizer in megatron-core 0.16)
    train_step: Callable[[int], float]


def build_gpt(
    tp: int = 1,
    pp: int = 1,
    bf16: bool = False,
    overlap_grad_reduce: bool = False,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 128,
    seq: int = 16,
    seed: int = 1234,
    *,
    heads: int = 4,
    ffn_hidden: int | None = None,
    bucket_size: int | None = None,
    micro_batch_size: int = 2,
    global_microbatches: int = 4,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    clip_grad: float = 1.0,
    share_embeddings: bool = True,
    initialize_parallel: bool = True,
    data_seed: int | None = None,
    llama: bool = False,
    experts: int = 0,
    ep: int = 1,
    etp: int | None = None,
    frozen: tuple[str, ...] = (),
    stage_layers: tuple[int, int] | None = None,
    vpp: int | None = None,
) -> ToyGPT:
    """Build the toy GPT on an already-initialized default process group (gloo; NCCL on a GPU).

    Calls ``parallel_state.initialize_model_parallel(tp, pp)`` (unless ``initialize_parallel`` is
    False), installs the CPU shim unless the process group is NCCL's on a machine with CUDA (then the model is
    initialized on the CPU as without it, and trained on the current GPU), seeds every RNG from ``seed`` and returns
    the model chunks, the optimizer exactly as ``get_megatron_optimizer`` returns it, and
    ``train_step(iteration) -> loss``. ``bucket_size`` (elements) only matters with
    ``overlap_grad_reduce=True``; a small one gives a buffer several buckets. ``data_seed`` (default
    ``seed``) seeds the data alone, so a model built with another ``seed`` sees the same batches.

    ``global_microbatches`` must be divisible by DP; with a power of two, gradients are also
    bit-identical across DP sizes (every rescaling is by a power of two).

    ``llama=True`` builds it Llama-shaped (RMSNorm, no linear biases, RoPE, separate output layer): a
    model Hugging Face's ``LlamaForCausalLM`` and mbridge's LLaMA bridge convert to and from.

    ``experts`` > 0 makes every MLP a mixture of that many experts (top-2 router, the allgather token
    dispatcher, which gloo can run; no linear biases), sharded over ``ep`` expert-parallel ranks; ``etp``
    splits each expert over that many expert-tensor-parallel ranks (Megatron's default: ``tp``).

    ``frozen`` names params (by substring of their names) that do not train (``requires_grad=False``): Megatron's
    DDP leaves them out of its buffers and the optimizer holds no state for them.

    ``stage_layers=(first, last)`` gives the first and last pipeline stages that many layers (Megatron-LM's
    ``--decoder-first/last-pipeline-num-layers``), the middle stages share the rest evenly.

    ``vpp`` builds that many model chunks per pipeline rank (the interleaved schedule, Megatron-LM's
    ``--num-layers-per-virtual-pipeline-stage``; needs ``pp`` > 1) as Megatron-LM's ``get_model`` does with
    megatron-core 0.16: ``initialize_model_parallel(virtual_pipeline_model_parallel_size=vpp)``, one
    ``GPTModel(vp_stage=i)`` per chunk with ``pre_process``/``post_process`` of its virtual stage, each in its
    own DDP (bucketing off past the first chunk), one optimizer over all chunks; ``train_step`` runs the
    interleaved schedule with one data iterator per chunk. ``global_microbatches`` // DP must then be a
    multiple of ``pp``. The config takes Megatron-LM's VPP defaults ``overlap_p2p_comm=True``,
    ``batch_p2p_comm=False``: with megatron-core 0.16's batched p2p (``batch_isend_irecv`` of
    send_prev, recv_prev, send_next, recv_next on every rank) at PP2 on gloo, where both neighbours are one
    rank, the loss of the same weights depended on the number of micro-batches (seen: 4.86254 at DP1, 4.86151
    at DP2, before any update; by our reading the ops pair one rank's activation with the other's gradient
    receive, not confirmed by a trace).
    With VPP the losses of DP sizes agree to float rounding, not bit for bit.
    """
    # the GPU only for NCCL ranks: gloo ranks (the tests, the demo) run on the CPU through the shim, GPU or not
    on_gpu = torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
    if device is None:
        from ckptd.testing.cpu_shim import install_cpu_shim

        install_cpu_shim()

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    data_seed = seed if data_seed is None else data_seed
    if experts:
        from megatron.core.transformer.moe import moe_utils

        # megatron-core 0.16 names TE's gemm in the router even without TE installed (NameError otherwise)
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    if vpp is not None and pp < 2:
        raise ValueError(f"vpp={vpp} needs pp > 1 (megatron-core's interleaved schedule), not pp={pp}")
    if initialize_parallel:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    dp = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    if global_microbatches % dp:
        raise ValueError(f"global_microbatches={global_microbatches} is not divisible by DP={dp}")
    local_microbatches = global_microbatches // dp

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)

    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn_hidden if ffn_hidden is not None else 2 * hidden,
        num_attention_heads=heads,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        # Megatron-LM's defaults with VPP (--overlap-p2p-communication on, so batch_p2p_comm off); the batched
        # ops pair the wrong tensors at PP2, where the previous and next stage are the same rank (see above)
        **({"overlap_p2p_comm": True, "batch_p2p_comm": False} if vpp is not None else {}),
        pipeline_dtype=dtype,
        params_dtype=torch.float32,
        bf16=bf16,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **({"normalization": "RMSNorm"} if llama else {}),
        **({"num_layers_in_first_pipeline_stage": stage_layers[0],
            "num_layers_in_last_pipeline_stage": stage_layers[1]} if stage_layers else {}),
        **({"num_moe_experts": experts, "expert_model_parallel_size": ep, "moe_router_topk": 2,
            "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False,
            "moe_aux_loss_coeff": 0.0, "expert_tensor_parallel_size": etp} if experts else {}),
        # megatron-core refuses to train MoE with TP but without sequence parallelism
        **({"sequence_parallel": True} if experts and tp > 1 else {}),
        # no linear biases: Llama has none, and at EP1 megatron-core 0.16 adds the expert bias in place
        # into an autograd view
        **({"add_bias_linear": False} if llama or experts else {}),
    )
    if config.sequence_parallel:
        _torch_norm_with_sequence_parallel()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=True,
        bucket_size=bucket_size,
    )
    model: list[torch.nn.Module] = []
    for vp_stage in range(vpp or 1):  # Megatron-LM's get_model: one chunk per virtual stage, built in order
        stage = {"ignore_virtual": False, "vp_stage": vp_stage} if vpp is not None else {}
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False),
            vocab_size=vocab,
            max_sequence_length=seq,
            pre_process=ps.is_pipeline_first_stage(**stage),
            post_process=ps.is_pipeline_last_stage(**stage),
            share_embeddings_and_output_weights=share_embeddings and not llama,
            **({"position_embedding_type": "rope"} if llama else {}),
            **({"vp_stage": vp_stage} if vpp is not None else {}),
        )
        if device is not None:  # initialized on the CPU (bit-reproducible), trained on this rank's GPU
            gpt.cuda(device)
        for name, param in gpt.named_parameters():
            if any(part in name for part in frozen):
                param.requires_grad_(False)
        module: torch.nn.Module = Float16Module(config, gpt) if bf16 else gpt
        # Megatron-LM: bucketing only for the first chunk (the others' grads are reduced as one bucket each)
        model.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                             disable_bucketing=vp_stage > 0))
    post = ps.is_pipeline_last_stage()  # this rank computes the loss (its last chunk is the model's last)

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        bf16=bf16,
        params_dtype=torch.float32,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(opt_config, model)

    config.finalize_model_grads_func = finalize_model_grads
    if overlap_grad_reduce:  # as Megatron-LM's train(): one per chunk, a bare one for a single chunk
        no_sync = [c.no_sync for c in model]
        grad_sync = [c.start_grad_sync for c in model]
        config.no_sync_func = no_sync if len(model) > 1 else no_sync[0]
        config.grad_sync_func = grad_sync if len(model) > 1 else grad_sync[0]

    forward_backward = get_forward_backward_func()
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1).view(1, 1, seq, seq)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch_size, seq)

    def batch(iteration: int, j: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(data_seed * 1_000_003 + iteration * 1_009 + j)
        tokens = torch.randint(0, vocab, (micro_batch_size, seq + 1), generator=g).to(device)
        return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator: Any, model_chunk: torch.nn.Module) -> Any:
        b = next(data_iterator)
        out = model_chunk(b["tokens"], positions, mask, labels=b["labels"])
        return out, loss_func

    pp_group = ps.get_pipeline_model_parallel_group()
    dp_group = ps.get_data_parallel_group()
    last_pp_rank = dist.get_global_rank(pp_group, pp - 1) if pp > 1 else None

    def train_step(iteration: int) -> float:
        """One optimizer step; returns the mean loss of the global batch (before the update)."""
        for c in model:
            c.zero_grad_buffer()  # type: ignore[operator]
        optimizer.zero_grad()
        batches = [batch(iteration, dp_rank * local_microbatches + i) for i in range(local_microbatches)]
        # the interleaved schedule takes one iterator per chunk, each over the same micro-batches
        data: Any = [iter(batches) for _ in model] if len(model) > 1 else iter(batches)
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=model,
            num_microbatches=local_microbatches,
            seq_length=seq,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
        ok, _grad_norm, _ = optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step {iteration} was skipped")
        if post:
            local = torch.stack([r["loss"] for r in reduced])
            gathered = [torch.empty_like(local) for _ in range(dp)]
            dist.all_gather(gathered, local, group=dp_group)
            loss = torch.cat(gathered).double().sum() / global_microbatches
        else:
            loss = torch.zeros((), dtype=torch.float64, device=device)
        if last_pp_rank is not None:
            dist.broadcast(loss, src=last_pp_rank, group=pp_group)
        return float(loss)

    return ToyGPT(model, optimizer, train_step)


# --- launcher --------------------------------------------------------------------------------------
def _torch_norm_with_sequence_parallel() -> None:
    """Let the local spec's torch norms run under sequence parallelism (megatron-core asserts it off without
    TE/Apex). A norm is per token, so only its weights' gradients need the all-reduce over TP that Megatron
    gives params marked ``sequence_parallel``, as its own fused norms mark theirs."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(WrappedTorchNorm, "_ckptd_sequence_parallel", False):
        return
    plain = WrappedTorchNorm.__new__

    def new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
        sp, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm: torch.nn.Module = plain(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = sp
        for param in norm.parameters():
            param.sequence_parallel = sp  # type: ignore[attr-defined]
        return norm

    WrappedTorchNorm.__new__ = new
    WrappedTorchNorm._ckptd_sequence_parallel = True


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; a thin wrapper over
    :func:`ckptd.testing.launch.run_ranks` (forkserver with torch and megatron-core preloaded).

    Returns each rank's return value; a failing rank raises :class:`RankFailedError` with its traceback.
    """
    return run_ranks(fn, world_size, *args, timeout_s=timeout_s)


def spawn_with_daemon(
    fn: Callable[..., Any], world_size: int, root: str, socket_path: str, *args: Any, log_path: str | None = None,
    timeout_s: float = 300.0, daemon_args: Sequence[str] = (),
) -> list[Any]:
    """:func:`spawn_ranks` of ``fn(rank, world_size, socket_path, root, *args)`` while a ``ckptd serve`` daemon
    (64 MiB arena, then ``daemon_args``) serves ``root`` on ``socket_path``; the daemon is stopped afterwards,
    whatever happened."""
    daemon = DaemonProcess(
        root, socket_path, "--arena-size", "64MiB", "--no-prefault", *daemon_args, log_path=log_path
    ).wait_ready()
    try:
        return spawn_ranks(fn, world_size, daemon.socket, root, *args, timeout_s=timeout_s)
    finally:
        daemon.stop(timeout=20)


def saved_and_merged(fn: Callable[..., Any], world_size: int, tmp: str, *args: Any) -> tuple[str, str, list[Any]]:
    """A step saved by ``fn(rank, world_size, socket_path, *args)`` on ``world_size`` ranks under ``tmp/plain``
    (a ``ckptd serve`` daemon for the save), then a copy of it merged (``ckptd merge``, in process) under
    ``tmp/merged``: ``(merged, plain, the ranks' results)``, for loads from both."""
    from ckptd.testing.launch import socket_dir
    from ckptd.writer.merge import merge

    plain, merged = os.path.join(tmp, "plain"), os.path.join(tmp, "merged")
    with socket_dir("ckm-") as sockets:
        daemon = DaemonProcess(plain, os.path.join(sockets, "d.sock"), "--arena-size", "64MiB", "--no-prefault",
                               log_path=os.path.join(tmp, "daemon.log")).wait_ready()
        try:
            results = spawn_ranks(fn, world_size, daemon.socket, *args)
        finally:
            daemon.stop(timeout=20)
    shutil.copytree(plain, merged)
    assert merge(merged, progress=False).tasks > 0
    return merged, plain, results
