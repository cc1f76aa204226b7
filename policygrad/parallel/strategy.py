"""How a run spreads over processes, chosen once from the config: :class:`Single` (one process),
:class:`DDP` (whole networks on every rank, gradients summed after the backward passes) or
:class:`FSDP` (FSDP2-sharded networks, :mod:`policygrad.parallel.sharding`).

A strategy is built before the parts of a run and handed to each at construction (the policy
step, the critic, the optimizer steps, the reward normaliser); nothing is attached afterwards.
What differs between the three is asked of the object, never of a name:

- ``reduce``: None in one process (the parts then run their single-process code, bit for bit),
  else a data-parallel ``reduce(tensor, op) -> tensor`` over ranks (:meth:`Dist.reduce`);
- :meth:`prepare_models`: FSDP keeps an unsharded copy of the policy for the rollout engine and
  the exports, then shards the policy and the reference; :meth:`prepare_critic` shards the critic;
- :meth:`sync_engine`: the engine receives the policy's weights (FSDP: gathered into the copy);
- :meth:`sync_gradients` after the backward passes (DDP: summed over ranks; FSDP reduce-scattered
  them in the backward, so only finiteness is agreed) and ``collective`` (FSDP: every backward is
  a collective, so a rank keeps backpropagating after a non-finite loss);
- :meth:`idle_passes`: how many zero-weight passes a rank with fewer micro-batches runs so that
  the sharded collectives pair up (FSDP only);
- checkpoints: ``shards_state`` (FSDP writes weights and AdamW state per rank with
  ``torch.distributed.checkpoint``), :meth:`write_shards`, and ``saves_alone`` (whether rank 0 can
  write a checkpoint when the other ranks are not there, e.g. after an error on one of them).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from collections.abc import Callable

import torch

from policygrad.config.train import ConfigError, TrainConfig
from policygrad.errors import CheckpointSaveError, fsdp_lora_refusal
from policygrad.models.adapters import is_peft_model
from policygrad.parallel.distributed import Dist
from policygrad.parallel.precision import Precision
from policygrad.parallel.sharding import copy_full_weights, full_state_dict, shard_model
from policygrad.parallel.state import SHARDED_DIR, save_sharded_state

__all__ = ["DDP", "FSDP", "Single", "Strategy", "make_strategy"]

Reduce = Callable[..., torch.Tensor]


class Single:
    """One process: every method is the identity, ``reduce`` is None."""

    name = "single"
    collective = False  # a backward involves no other rank
    shards_state = False  # checkpoints hold whole networks and optimizer states
    saves_alone = True  # rank 0 may save without the others (there are none)

    def __init__(self, dist: Dist, *, model_name: str = ""):
        self.dist = dist
        self.model_name = model_name  # for messages
        self.full_policy: torch.nn.Module | None = None  # FSDP's unsharded copy; None elsewhere

    @property
    def reduce(self) -> Reduce | None:
        """None with one process; a sum (or max/min) over ranks with several."""
        return self.dist.reduce if self.dist.active else None

    def prepare_models(self, models, *, engine_name: str, precision: Precision):
        """The models the rollout engine is built from (here: the loaded ones, unchanged)."""
        del engine_name, precision  # used by FSDP
        return models

    def prepare_critic(self, critic) -> None:
        """Called after the critic's checkpoint weights load, before its optimizer exists."""

    def engine_policy(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The whole policy the engine samples from and checkpoints/exports write."""
        return policy

    def sync_engine(self, engine, policy: torch.nn.Module) -> None:
        """Give ``engine`` the policy's current weights (a collective under FSDP)."""
        engine.sync_weights(policy)

    def sync_gradients(self, params: list[torch.nn.Parameter], finite: bool) -> bool:
        """After the backward passes: gradients of the global batch, and whether every rank's
        losses were finite."""
        del params
        return finite

    def idle_passes(self, count: int) -> int:
        """Zero-weight passes to add to this rank's ``count`` micro-batches (0: none)."""
        del count
        return 0

    def write_shards(self, path: str, models: dict, *, tmp: str) -> tuple[str | None, dict | None]:
        """The part of checkpoint ``path`` every rank writes into the save's temporary folder
        ``tmp`` (none here). Returns ``(temporary folder or None, the critic's full weights or None)``."""
        del path, models, tmp
        return None, None


class DDP(Single):
    """Whole networks on every rank; gradients summed over ranks after the backward passes
    (:meth:`Dist.sync_gradients`), with the decision whether every rank's losses were finite."""

    name = "ddp"

    def sync_gradients(self, params: list[torch.nn.Parameter], finite: bool) -> bool:
        return self.dist.sync_gradients(params, finite)


class FSDP(Single):
    """FSDP2-sharded policy, reference and critic (see :mod:`policygrad.parallel.sharding`)."""

    name = "fsdp"
    collective = True
    shards_state = True
    saves_alone = False  # a sharded save needs every rank

    def prepare_models(self, models, *, engine_name: str, precision: Precision):
        """Keep an unsharded copy of the policy for the engine and the exports (in the master
        weights' dtype: checkpoints' model folders and exports are written from it; on the CPU
        for vLLM, which holds its own weights), then shard the policy and the reference (which
        computes as the policy does, or the first KL is not 0).

        Raises:
            ConfigError: the policy is a LoRA adapter (a LoRA run trains an adapter every rank holds);
                fp16-mixed or an fp32 head (FSDP2's mixed-precision policy casts every gathered
                weight, the head's too, and its gradient shards would need a sharded scaler).
        """
        if is_peft_model(models.policy):
            raise ConfigError(
                f"distributed.strategy=fsdp shards full fine-tuning, and model.name={self.model_name!r} is "
                "a LoRA adapter; a LoRA run trains a small adapter every rank can hold: set "
                "distributed.strategy=ddp"
            )
        if precision.loss_scaling or precision.head_dtype is not None:
            field = "model.precision=fp16-mixed" if precision.loss_scaling else "model.lm_head_dtype=float32"
            raise ConfigError(
                f"{field} is not supported with distributed.strategy=fsdp; use distributed.strategy=ddp, "
                "or model.precision=bf16-mixed without model.lm_head_dtype"
            )
        self.full_policy = copy.deepcopy(models.policy).requires_grad_(False).eval()
        if engine_name in ("vllm", "server"):  # a copy on the host, pushed from there
            self.full_policy = self.full_policy.to("cpu")
        self.compute_dtype = precision.autocast_dtype
        shard_model(models.policy, compute_dtype=self.compute_dtype)
        if models.reference is not None:
            shard_model(models.reference, compute_dtype=self.compute_dtype)
        return dataclasses.replace(models, policy=self.full_policy)

    def prepare_critic(self, critic) -> None:
        shard_model(critic, compute_dtype=self.compute_dtype)

    def engine_policy(self, policy: torch.nn.Module) -> torch.nn.Module:
        del policy  # sharded: the unsharded copy is the whole policy
        return self.full_policy

    def sync_engine(self, engine, policy: torch.nn.Module) -> None:
        copy_full_weights(policy, self.full_policy)
        engine.sync_weights(self.full_policy)

    def sync_gradients(self, params: list[torch.nn.Parameter], finite: bool) -> bool:
        del params  # FSDP reduce-scattered the gradients in the backward
        return self.dist.agree_finite(finite)

    def idle_passes(self, count: int) -> int:
        return self.dist.equal_passes(count) - count

    def write_shards(self, path: str, models: dict, *, tmp: str) -> tuple[str | None, dict | None]:
        """Every rank writes its shards (``sharded/``) into rank 0's ``tmp``, the temporary folder
        of checkpoint ``path``'s save (each rank names its own; rank 0's is taken), and the
        critic's weights are gathered to rank 0; rank 0 then completes the transaction from that
        folder. A collective.

        ``models``: ``{"policy": (module, optimizer), "critic": (module, optimizer)}`` (critic optional).

        Raises:
            CheckpointSaveError: a shard could not be written (the temporary folder is removed).
        """
        dist = self.dist
        tmp = dist.broadcast_object(tmp if dist.is_main else None)
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        try:
            save_sharded_state(os.path.join(tmp, SHARDED_DIR), models)
            critic = models.get("critic")
            critic_state = full_state_dict(critic[0], rank0_cpu=True) if critic is not None else None
        except Exception as exc:
            if dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveError(f"could not write the shards of checkpoint {path}: {exc}") from exc
        return tmp, critic_state


Strategy = Single  # the interface every strategy implements


def make_strategy(cfg: TrainConfig, dist: Dist) -> Single:
    """The strategy of ``distributed.strategy`` (``auto`` resolved for the device) with several
    processes, :class:`Single` with one.

    Raises:
        ConfigError: ``fsdp`` with LoRA (``model.lora.rank`` or ``model.adapter``).
    """
    if not dist.active:
        return Single(dist, model_name=cfg.model.name)
    name = cfg.distributed.resolved(dist.device.type)
    if name == "fsdp":
        if cfg.model.lora.rank or cfg.model.adapter:
            raise ConfigError(
                fsdp_lora_refusal(
                    strategy="distributed.strategy",
                    lora="model.lora.rank or model.adapter",
                    ddp="distributed.strategy=ddp",
                )
            )
        return FSDP(dist, model_name=cfg.model.name)
    return DDP(dist, model_name=cfg.model.name)
