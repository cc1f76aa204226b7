"""The models of a run: the policy to train (a model name, a trained adapter, or a caller's model
object), the frozen reference (or the policy itself under ``policy_as_reference``), and the
model of ``policygrad eval``. :func:`build_models` is called by
:func:`~policygrad.trainer.factory.build_trainer` after the checks that need no model."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from policygrad.config.train import ConfigError, ModelConfig, TrainConfig
from policygrad.models.adapters import (
    FrozenStart,
    describe_model,
    is_peft_model,
    load_model,
    merged_model,
    merged_weights,
    resolve_model_source,
)
from policygrad.models.loading import (
    apply_lora,
    disable_dropout,
    eos_token_ids,
    load_tokenizer,
    prepare_tokenizer,
)
from policygrad.models.swiglu import use_memory_efficient_mlp
from policygrad.parallel.state import load_policy_weights

__all__ = ["Models", "adopt_model", "build_models", "load_eval_models", "record_model_object"]


@dataclass
class Models:
    """The policy (trainable), the tokenizer, end-of-sequence ids, and the reference: a frozen
    model (``reference``), or the policy itself inside ``policy_as_reference()`` (LoRA: the base
    under ``disable_adapter``; a run started from a trained adapter: that adapter's starting
    weights), or neither without a KL.

    ``model_path`` is the folder an engine or critic loads the architecture (and, unless
    ``weights_differ_from_path``, the weights) from."""

    model_path: str
    tokenizer: object
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    eos_ids: list[int]
    policy_as_reference: Callable[[], AbstractContextManager] | None = None
    weights_differ_from_path: bool = False


def build_models(
    cfg: TrainConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    checkpoint: str | None,
    model=None,
    tokenizer=None,
    run_dir: str | None = None,
    policy_dtype: torch.dtype | None = None,
) -> Models:
    """Load the policy (a trained adapter to start from, LoRA, memory-efficient MLPs, checkpoint
    weights, gradient checkpointing) and, when the KL placement needs one, the reference: the
    starting policy, frozen. The policy's parameters and the reference's are ``policy_dtype``
    (the precision's: float32 unless bf16-pure; None: ``dtype``): the reference runs under the
    policy's autocast, so two copies of the starting weights compute the same log-probs and
    the KL is exactly 0 before the first update (a bf16 reference next to float32 master
    weights gave a KL of ~6e-3 at step 0).

    Args:
        cfg: the run's config (``model`` section).
        model, tokenizer: a loaded transformers model (or peft model) to train instead of
            ``model.name``, and its tokenizer (None: read from the model's folder). The model is
            trained in place; without a local folder of its own it is written to
            ``run_dir/start_model`` for engines and critics that load from a folder.
        checkpoint: a checkpoint folder whose policy weights are loaded (resume).

    Raises:
        ConfigError: ``model.lora.rank`` set for a run that starts from an adapter.
        ValueError / OSError: as :func:`policygrad.models.adapters.resolve_model_source`.
    """
    trained = policy_dtype or dtype
    source = None
    if model is None:
        source = resolve_model_source(cfg.model.name, cfg.model.adapter)
        trust = cfg.model.trust_remote_code  # False: a model folder's own code never runs, never asks
        tokenizer = load_tokenizer(source.tokenizer, trust_remote_code=trust)
        policy = load_model(source, dtype=trained, trainable=True, trust_remote_code=trust).to(device)
        model_path = source.base
    else:
        policy, tokenizer, model_path = adopt_model(model, tokenizer, dtype=trained, run_dir=run_dir)
        policy = policy.to(device)
    from_adapter = is_peft_model(policy)
    lora = cfg.model.lora
    if from_adapter and lora.rank > 0:
        raise ConfigError(
            f"model.lora.rank={lora.rank}: this run starts from a trained adapter and trains it (its own "
            "rank and targets); unset model.lora.rank, or start from a full model"
        )
    start = None
    needs_reference = cfg.kl_placement.needs_reference
    if needs_reference and model is not None and not from_adapter and lora.rank == 0:
        start = copy.deepcopy(policy)  # an object the caller passed: its starting weights, frozen
    elif from_adapter and needs_reference:
        start = FrozenStart(policy)  # before any checkpoint weights load
    if lora.rank > 0:
        policy = apply_lora(
            policy, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules
        )
    # SwiGLU MLPs and RMSNorms that save their inputs only and recompute the rest in the backward:
    # ~a third less activation memory, same result. After LoRA, so adapted projections keep their adapters.
    use_memory_efficient_mlp(policy)
    if checkpoint is not None:
        load_policy_weights(policy, os.path.join(checkpoint, "model"))
    if cfg.model.gradient_checkpointing is True:  # auto: decided at the updates (trainer.recompute)
        policy.gradient_checkpointing_enable()
    reference, as_reference = None, None
    if isinstance(start, FrozenStart):
        as_reference = start.active
    elif isinstance(start, torch.nn.Module):
        reference = start.eval().requires_grad_(False)
    elif needs_reference and lora.rank > 0:
        as_reference = policy.disable_adapter  # LoRA: the base weights are the starting policy
    elif needs_reference:
        reference = load_model(
            source, dtype=trained, trainable=False, trust_remote_code=cfg.model.trust_remote_code
        ).to(device)
    differ = from_adapter or model is not None
    return Models(
        model_path, tokenizer, policy, reference, eos_token_ids(tokenizer, policy), as_reference, differ
    )


def load_eval_models(cfg: TrainConfig, *, device: torch.device, dtype: torch.dtype) -> Models:
    """The model of ``model.name`` / ``model.adapter`` for evaluation only: frozen, in eval mode,
    a LoRA adapter merged into the weights (plain generation speed).

    Raises:
        ValueError / OSError: as :func:`policygrad.models.adapters.resolve_model_source`.
    """
    source = resolve_model_source(cfg.model.name, cfg.model.adapter)
    trust = cfg.model.trust_remote_code
    tokenizer = load_tokenizer(source.tokenizer, trust_remote_code=trust)
    policy = merged_model(load_model(source, dtype=dtype, trainable=False, trust_remote_code=trust))
    policy = policy.to(device)
    policy.requires_grad_(False)
    return Models(
        source.base,
        tokenizer,
        policy,
        None,
        eos_token_ids(tokenizer, policy),
        weights_differ_from_path=source.adapter is not None,
    )


def record_model_object(cfg: TrainConfig, model) -> TrainConfig:
    """``cfg`` with ``model.name`` naming ``model``, a loaded model the run trains instead of
    loading one (:func:`~policygrad.models.adapters.describe_model`), so ``config.yaml`` records
    what was trained. The default ``model.name`` is replaced; the same folder is kept.

    Raises:
        ConfigError: ``model.name`` names another model (a resume from this config would load it).
    """
    named = describe_model(model)
    name = cfg.model.name
    same = name == named or (
        not named.startswith("<") and os.path.realpath(os.path.expanduser(name)) == os.path.realpath(named)
    )
    if same:
        return cfg
    if name != ModelConfig().name:
        raise ConfigError(
            f"model.name={name!r} names another model than the model object the run trains ({named}); "
            "config.yaml would record the wrong model for --resume: leave model.name unset, or set it to "
            f"{named!r}"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=named))


def adopt_model(model, tokenizer, *, dtype: torch.dtype, run_dir: str | None):
    """A caller's loaded model made ready to train (dropout off, no KV cache, train mode, every
    parameter trainable unless it is a peft model, whose adapter alone trains; cast to ``dtype``
    when its floating-point parameters differ), its tokenizer (a copy, padded on the left) and the
    folder engines load its architecture from.

    Returns:
        ``(model, tokenizer, folder)``.

    Raises:
        TypeError: ``model`` is not a torch module with a transformers config.
        ValueError: no tokenizer given and none in the model's folder.
    """
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise TypeError(
            f"model must be a transformers model (or a peft model around one), got {type(model).__name__}"
        )
    peft = is_peft_model(model)
    base = model.get_base_model() if peft else model
    folder = getattr(base, "name_or_path", "") or ""
    local = bool(folder) and os.path.isfile(os.path.join(os.path.expanduser(folder), "config.json"))
    if tokenizer is None:
        if not local:
            raise ValueError(
                "tokenizer: the model has no local folder to read its tokenizer from; pass tokenizer="
            )
        tokenizer = load_tokenizer(folder)
    else:
        tokenizer = prepare_tokenizer(copy.deepcopy(tokenizer))
    if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype)
    disable_dropout(model)
    base.config.use_cache = False
    model.train()
    if not peft:
        model.requires_grad_(True)
    if not local:
        if run_dir is None:
            raise ValueError("the model has no local folder; give run_dir to write one")
        folder = os.path.join(run_dir, "start_model")
        state = dict(merged_weights(model)) if peft else None  # plain names an engine can load
        base.save_pretrained(folder, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    return model, tokenizer, os.path.expanduser(folder)
