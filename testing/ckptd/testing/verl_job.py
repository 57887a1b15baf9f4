"""What a verl 0.9 Megatron job runs around its checkpoint manager, on CPU, for tests and ``ckptd demo --trainer verl``.

Test/demo code only (needs the ``ckptd[verl]`` extra). In a rank process, :func:`build_managers` does what
a Ray worker and verl's Megatron engine do: run the setup hook string (Ray's own loader), then build
``MegatronCheckpointManager`` as ``verl.workers.engine.megatron.transformer_impl`` looks it up, with the
engine's keyword arguments, around a real megatron-core GPT, distributed optimizer and
``OptimizerParamScheduler`` per role. With ``hf_dir`` it is verl's default model mode
(``use_dist_checkpointing: False``): a Llama-shaped toy model, a Hugging Face config and tokenizer, and
an mbridge bridge that loaded the initial weights from ``hf_dir`` (as the engine does) and that verl's
own save path uses to write HF weights.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any, NamedTuple

import torch

ROLES = {"actor": 1234, "critic": 999}  # role -> model seed (two different models in one job)
PRELOAD = ["verl.utils.checkpoint.megatron_checkpoint_manager", "verl.workers.engine.megatron.transformer_impl"]
HOOK = "ckptd.integrations.verl.install"  # Ray's runtime_env worker_process_setup_hook
TRACKER = "latest_checkpointed_iteration.txt"  # what verl's resume_mode=auto reads
# the toy model's shape; the Hugging Face config below must match it (llama=True)
TOY = {"hidden": 64, "layers": 2, "vocab": 128, "seq": 16, "heads": 4, "ffn_hidden": 128}


class Role(NamedTuple):
    """One role's manager (verl's class as the engine looks it up), its train step and LR scheduler."""

    manager: Any
    train_step: Any
    sched: Any


def build_managers(
    hook: str, seed_offset: int, async_save: bool, roles: dict[str, int] = ROLES, hf_dir: str | None = None,
    global_microbatches: int = 4,
) -> dict[str, Role]:
    """Managers for ``roles`` as verl's Megatron engine builds them, after Ray ran the setup hook ``hook``.

    Without ``hf_dir``: ``use_dist_checkpointing=True``, no bridge. With it (verl's default model mode):
    ``use_dist_checkpointing=False``, a Llama-shaped model whose initial weights the bridge loads from
    ``hf_dir`` (see :func:`write_hf_model`), and the HF config and tokenizer verl saves next to them.
    ``global_microbatches`` must be divisible by the world size (every rank is a DP rank).
    """
    from ray._private.runtime_env.setup_hook import load_and_execute_setup_hook

    from ckptd.testing.toy_gpt import build_gpt

    error = load_and_execute_setup_hook(hook)  # what a Ray worker does with runtime_env's hook string
    if error is not None:
        raise RuntimeError(error)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.utils import unwrap_model
    from omegaconf import OmegaConf
    from verl.workers.config.checkpoint import McoreCheckpointConfig
    from verl.workers.engine.megatron import transformer_impl

    cls: Any = transformer_impl.MegatronCheckpointManager  # type: ignore[attr-defined]  # the engine's lookup
    out = {}
    for i, (role, seed) in enumerate(roles.items()):
        model: Any
        model, optimizer, train_step = build_gpt(
            hidden=TOY["hidden"], layers=TOY["layers"], vocab=TOY["vocab"], seq=TOY["seq"], heads=TOY["heads"],
            ffn_hidden=TOY["ffn_hidden"], seed=seed + seed_offset, data_seed=seed, initialize_parallel=i == 0,
            llama=hf_dir is not None, global_microbatches=global_microbatches,
        )
        sched = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=10, lr_decay_steps=20,  # warmup only
            lr_decay_style="linear", start_wd=0.01, end_wd=0.01, wd_incr_steps=20, wd_incr_style="constant",
        )
        hf_config = bridge = tokenizer = None
        if hf_dir is not None:
            hf_config, tokenizer = tiny_llama_config(), tiny_tokenizer()
            bridge = llama_bridge(hf_config)
            bridge.load_weights(model, hf_dir)  # the engine's init in HF mode: weights from model.path
        tmp_config = OmegaConf.create({"model": {"path": hf_dir or "unused"}, "megatron": {
            "dist_ckpt_optim_fully_reshardable": False, "distrib_optim_fully_reshardable_mem_efficient": False}})
        mgr = cls(  # the keyword arguments of verl/workers/engine/megatron/transformer_impl.py
            config=tmp_config, checkpoint_config=McoreCheckpointConfig(async_save=async_save), model_config=None,
            transformer_config=unwrap_model(model[0]).config, role=role, model=model, arch="GPTModel",
            hf_config=hf_config, param_dtype=torch.float32, share_embeddings_and_output_weights=hf_dir is None,
            processing_class=tokenizer, optimizer=optimizer, optimizer_scheduler=sched, use_distributed_optimizer=True,
            use_checkpoint_opt_param_scheduler=True, use_dist_checkpointing=hf_dir is None, bridge=bridge,
            provider=None, peft_cls=None, use_megatron_fsdp=False,
        )
        out[role] = Role(mgr, train_step, sched)
    return out


def train(managers: dict[str, Role], start: int, n: int, sched_too: bool = True) -> None:
    """``n`` optimizer steps of every role from iteration ``start`` (and its scheduler step)."""
    for r in managers.values():
        for it in range(start, start + n):
            r.train_step(it)
            if sched_too:
                r.sched.step(1)


def snapshot(mgr: Any) -> dict[str, Any]:
    """Copies of the manager's model tensors, owned optimizer state and scheduler state."""
    from megatron.core.utils import unwrap_model

    from ckptd.testing.fixtures import megatron_owned_state

    model = {k: v.detach().clone() for k, v in unwrap_model(mgr.model[0]).state_dict().items()
             if isinstance(v, torch.Tensor)}
    optim = {e["name"]: (e["range"], {k: t.clone() for k, t in e["tensors"].items()})
             for e in megatron_owned_state(mgr.optimizer)}
    return {"model": model, "optim": optim, "sched": mgr.lr_scheduler.state_dict()}


def same(a: Any, b: Any, where: str) -> int:
    """Raise AssertionError naming the first difference of two snapshots; else the tensors compared."""
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            raise AssertionError(f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"{where} differs")
        return 1
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise AssertionError(f"{where}: {sorted(a)} vs {sorted(b)}")
        return sum(same(a[k], b[k], f"{where}/{k}") for k in a)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise AssertionError(f"{where}: {len(a)} vs {len(b)} items")
        return sum(same(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True)))
    if a != b:
        raise AssertionError(f"{where}: {a!r} vs {b!r}")
    return 0


def committed(root: str) -> list[int]:
    """The committed steps of a ckptd root."""
    from ckptd.writer.root import open_root
    from ckptd.writer.sync import run_sync

    async def run() -> list[int]:
        async with open_root(root) as ckpt:
            return sorted(await ckpt.committed_steps())

    return run_sync(run())


# --- verl's default model mode: Hugging Face weights through a bridge ------------------------------------
def tiny_llama_config() -> Any:
    """The smallest ``LlamaConfig`` matching the toy model built with ``llama=True`` and :data:`TOY`."""
    from transformers import LlamaConfig

    shape: dict[str, Any] = {
        "vocab_size": TOY["vocab"], "hidden_size": TOY["hidden"], "intermediate_size": TOY["ffn_hidden"],
        "num_hidden_layers": TOY["layers"], "num_attention_heads": TOY["heads"], "num_key_value_heads": TOY["heads"],
        "max_position_embeddings": TOY["seq"], "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_theta": 10000.0,  # mbridge reads it; megatron-core's RoPE default
    }
    return LlamaConfig(**shape)


def tiny_tokenizer() -> Any:
    """A word-level tokenizer over the toy vocabulary, built in memory (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TOY["vocab"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2")


def write_hf_model(path: str, seed: int = 5) -> None:
    """A randomly initialized ``LlamaForCausalLM`` of :func:`tiny_llama_config` saved as safetensors: the
    Hugging Face model a verl run starts from (``actor_rollout_ref.model.path``)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)  # type: ignore[no-untyped-call]
    tiny_tokenizer().save_pretrained(path)


@cache
def _bridge_class() -> type:
    import verl.models.mcore.mbridge  # noqa: F401  (verl's patches to mbridge, as the engine imports it)
    from mbridge.models.llama import LLaMABridge

    class LocalSpecLLaMABridge(LLaMABridge):  # type: ignore[misc]
        """mbridge's LLaMA bridge for megatron-core's local layer spec (no Transformer Engine on CPU): its
        norms are ``input_layernorm``/``pre_mlp_layernorm`` instead of TE's fused ``layer_norm_weight``."""

        _MLP_MAPPING = {**LLaMABridge._MLP_MAPPING,
                        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]}
        _OTHER_MAPPING = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}

    return LocalSpecLLaMABridge


def llama_bridge(hf_config: Any) -> Any:
    """An mbridge bridge (verl's ``vanilla_mbridge`` flavour) for the toy model, in fp32."""
    return _bridge_class()(hf_config, dtype=torch.float32)


def hf_files(path: str) -> list[str]:
    """Every file under ``path``, relative, sorted."""
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
