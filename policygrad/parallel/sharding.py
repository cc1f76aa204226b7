"""FSDP2 sharding of the trained and frozen networks (``distributed.strategy: fsdp``).

Each decoder layer is one ``fully_shard`` unit, then the root (embeddings, final norm, output
head; tied embeddings stay in one unit): a rank holds 1/N of every parameter as a ``DTensor``
shard, and so 1/N of the gradients and of AdamW's moments, which the optimizer creates from the
sharded parameters (Zhao et al. 2023, "PyTorch FSDP"; ``torch.distributed.fsdp.fully_shard``).
A forward all-gathers one unit's parameters at a time, a backward reduce-scatters its gradients.

Gradients are **summed** over ranks, not averaged: the policy and value losses are already
normalised by the global token or sequence counts (see :mod:`policygrad.parallel.distributed`), so
the sum of the ranks' gradients is the gradient of the global batch, as in the DDP-style strategy.

Mixed precision: with ``model.precision: bf16-mixed`` FSDP2's ``MixedPrecisionPolicy`` casts the
all-gathered parameters to bfloat16 for compute and reduces gradients in float32; the sharded
parameters and optimizer state stay float32.

Collectives need every rank to run the same sequence of sharded forwards and backwards: the
trainer pads a rank that has fewer micro-batches in a minibatch with zero-weight passes
(:meth:`policygrad.parallel.distributed.Dist.equal_passes`), and the rollout engine samples from
an unsharded copy of the policy (``FSDP.full_policy``, :mod:`policygrad.parallel.strategy`),
synced after each update with :func:`copy_full_weights`, since sequences of different lengths
would make the ranks' generation loops differ.
"""

from __future__ import annotations

import torch

__all__ = [
    "copy_full_weights",
    "decoder_layers",
    "full_state_dict",
    "is_sharded",
    "local_bytes",
    "shard_model",
]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of ``model``: the modules whose class a transformers model
    names in ``_no_split_modules`` (what accelerate wraps per unit), else the children of its
    longest ``ModuleList``.

    Raises:
        ValueError: no such blocks (a model that is not a transformer stack)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no decoder layers to shard")
    return list(max(lists, key=len))


def shard_model(model: torch.nn.Module, *, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Apply FSDP2 to ``model`` in place (each decoder layer, then the root) over the default
    process group, with gradients summed over ranks. Returns ``model``.

    Args:
        model: a transformers model or :class:`~policygrad.models.value.ValueModel` on this
            rank's device, parameters in their master dtype (float32 unless ``bf16-pure``).
        compute_dtype: bfloat16 for FSDP2 mixed precision (parameters cast for compute,
            gradients reduced in float32), or None (compute in the parameters' dtype).
    """
    # FSDP2 loads only for distributed.strategy=fsdp
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    reduce_dtype = torch.float32 if compute_dtype is not None else None
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum over ranks: losses carry the global counts
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return model


def is_sharded(model: torch.nn.Module | None) -> bool:
    """``model`` was passed to :func:`shard_model`."""
    # FSDP2 loads only for distributed.strategy=fsdp
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: torch.nn.Module, *, rank0_cpu: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded weights of a sharded ``model`` (a collective: every rank calls it).

    ``rank0_cpu``: gathered to CPU on rank 0 only (the other ranks get ``{}``), for writing files;
    else every rank gets the full tensors on its device."""
    # FSDP2 loads only for distributed.strategy=fsdp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_cpu)
    return get_model_state_dict(model, options=options)


@torch.no_grad()
def copy_full_weights(sharded: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy a sharded model's current weights into ``target``, an unsharded module of the same
    architecture (every rank calls it: the gather is a collective). Tied weights are copied once.

    Raises:
        KeyError: a parameter of ``target`` has no weight of that name in ``sharded``."""
    state = full_state_dict(sharded)
    for name, param in target.named_parameters():
        if name not in state:
            raise KeyError(f"{name} is missing from the sharded model's state")
        param.copy_(state[name])
    for name, buffer in target.named_buffers():
        if name in state:  # non-persistent buffers (rotary frequencies) are not state
            buffer.copy_(state[name])


def local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for ``model``'s trainable parameters, their gradients (one per
    trainable parameter, of its dtype, as after a backward) and ``optimizer``'s state tensors,
    counted from the local shards (a ``DTensor``'s ``to_local()``)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    trainable = [local(p) for p in model.parameters() if p.requires_grad]
    params = sum(p.numel() * p.element_size() for p in trainable)
    out = {"parameters": params, "gradients": params, "optimizer": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    out["optimizer"] += local(value).numel() * local(value).element_size()
    return out
