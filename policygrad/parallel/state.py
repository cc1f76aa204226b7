"""Network state in and out of a saved folder, as the parts that hold it load and write it: the
policy's weights (full safetensors or a LoRA adapter), a whole-network optimizer state (into
unsharded or FSDP-sharded parameters) and a ``torch.distributed.checkpoint`` folder of every
rank's shards (:data:`SHARDED_DIR`).

The trainer and the strategies use these to load and write their own state; where a checkpoint
folder sits in the run directory, and how its save is made a transaction, is
:mod:`policygrad.run.checkpoint`'s.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from policygrad.errors import CheckpointError
from policygrad.parallel.sharding import is_sharded

__all__ = [
    "SHARDED_DIR",
    "load_full_optimizer",
    "load_policy_weights",
    "load_sharded_state",
    "save_sharded_state",
]

SHARDED_DIR = "sharded"  # the torch.distributed.checkpoint folder inside a checkpoint folder


def save_sharded_state(folder: str, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]) -> None:
    """Write the weights and optimizer state of ``models`` (``{"policy": (module, optimizer),
    ...}``) with ``torch.distributed.checkpoint``: every rank writes its own shards into
    ``folder`` (a collective; every rank calls it with the same folder)."""
    state = {}
    for name, (model, optimizer) in models.items():
        weights, optim = get_state_dict(model, optimizer)
        state[name], state[f"{name}_optimizer"] = weights, optim
    dcp.save(state, checkpoint_id=folder)


def load_sharded_state(folder: str, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]) -> None:
    """Load :func:`save_sharded_state`'s folder into ``models``' networks and optimizers,
    resharded to this run's ranks (or into whole networks in one process)."""
    state = {}
    for name, (model, optimizer) in models.items():
        state[name], state[f"{name}_optimizer"] = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # one process reading a sharded checkpoint is intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder)
    for name, (model, optimizer) in models.items():
        set_state_dict(
            model, optimizer, model_state_dict=state[name], optim_state_dict=state[f"{name}_optimizer"]
        )


def load_full_optimizer(model, optimizer, saved: dict[str, Any]) -> None:
    """A whole-network optimizer state (``optimizer.state_dict()``: parameters by position) into
    ``optimizer``, whose parameters may be FSDP shards (each rank keeps its shard)."""
    if not is_sharded(model):
        optimizer.load_state_dict(saved)
    else:
        names = [n for n, p in model.named_parameters() if p.requires_grad]  # the order optimizers see
        by_name = {
            "state": {names[i]: value for i, value in saved["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
        }
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def load_policy_weights(model, folder: str) -> None:
    """Load saved policy weights (full model safetensors or a peft adapter) into ``model``.

    Raises:
        CheckpointError: the saved tensors do not match the model's.
    """
    adapter = os.path.join(folder, "adapter_model.safetensors")
    if os.path.exists(adapter):
        from peft import set_peft_model_state_dict  # peft loads only for an adapter (keeps the import light)

        set_peft_model_state_dict(model, load_file(adapter))
        return
    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            try:
                state.update(load_file(os.path.join(folder, name)))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
                raise CheckpointError(
                    f"checkpoint weights {os.path.join(folder, name)} cannot be read ({str(e)[:200]}); "
                    "the file is corrupt"
                ) from None
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape: another model's checkpoint
        first = str(e).strip().splitlines()
        raise CheckpointError(
            f"checkpoint {folder} does not match the model: {' '.join(first[1:2] or first[:1])[:300]}"
        ) from None
    missing = [k for k in missing if "lm_head" not in k]  # tied embeddings are saved once
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {folder} does not match the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
