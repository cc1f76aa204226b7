"""A :class:`~policygrad.trainer.loop.Trainer`'s state in and out of a checkpoint: the step, the
data position, the optimizers and schedules, the controllers, the reward normaliser, the RNG
states, the fp16 loss scale, the PPO-ptx position and the rollouts sampled ahead (k > 0). The
trainer's ``state_dict`` / ``load_state_dict`` / ``write_shards`` are these functions; a
:class:`~policygrad.run.Run` saves what they return and never reaches into the trainer."""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import torch

from policygrad.errors import CheckpointError
from policygrad.parallel.state import SHARDED_DIR, load_full_optimizer, load_sharded_state

__all__ = ["load_trainer_state", "networks", "trainer_state", "write_trainer_shards"]

log = logging.getLogger("policygrad")


def networks(trainer) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """The trained networks by name with their optimizers (the critic's when there is one)."""
    networks = {"policy": (trainer.policy, trainer.optimizer)}
    if trainer.critic_trainer is not None:
        networks["critic"] = (trainer.critic, trainer.critic_trainer.optimizer)
    return networks


def trainer_state(trainer) -> dict[str, Any]:
    """What the trainer needs to continue exactly where it is: step, data position, optimizer
    (None when the strategy writes it in shards: :func:`write_trainer_shards`), schedule, KL
    controller, reward normaliser, RNG states; with a critic its optimizer and schedule; with
    PPO-ptx the text position. Tensors by reference: valid until the next optimizer step."""
    sharded = trainer.strategy.shards_state
    state = {
        "step": trainer.step_idx,
        "data_position": trainer.stream.position,
        "optimizer": None if sharded else trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "kl_controller": trainer.kl_ctl.state_dict(),
        **({"entropy_controller": ctl.state_dict()} if (ctl := trainer.entropy_ctl) is not None else {}),
        "reward_normalizer": trainer.scorer.normalizer.state_dict(),
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        "precision": trainer.precision.name,  # what model.precision=auto resolved to, kept on resume
    }
    scaler = trainer.policy_step.step.scaler
    if scaler is not None:  # fp16-mixed: the loss scale and its growth count, for an exact resume
        state["grad_scaler"] = scaler.state_dict()
    if trainer.critic_trainer is not None:
        state["critic"] = trainer.critic_trainer.state_dict()
        if sharded:
            state["critic"]["optimizer"] = None
    if trainer.ptx_data is not None:
        state["ptx_position"] = trainer.ptx_data.position
    if sharded:
        state["sharded"] = SHARDED_DIR
    trainer.rollouts.save_into(state)  # k > 0: the batches sampled ahead, where their prompts end
    return state


def write_trainer_shards(
    trainer, path: str, *, tmp: str
) -> tuple[str | None, dict[str, torch.Tensor] | None]:
    """The part of checkpoint ``path`` that needs every rank (FSDP's shards, into rank 0's
    temporary folder ``tmp``; nothing otherwise): ``(temporary folder or None, the critic's full
    weights on rank 0 or None)``. A collective."""
    return trainer.strategy.write_shards(path, networks(trainer), tmp=tmp)


def load_trainer_state(trainer, state: dict[str, Any], *, checkpoint: str) -> None:
    """Put :func:`trainer_state`'s output (read from ``checkpoint``) back; a sharded optimizer
    state is read from the checkpoint's ``sharded/`` folder, resharded to this run's ranks.

    Raises:
        CheckpointError: the run has a critic but the checkpoint has no critic state.
    """
    trainer.step_idx = state["step"]
    trainer.stream.position = state["data_position"]
    trainer.rollouts.load_from(state, checkpoint=checkpoint)
    critic = trainer.critic_trainer
    if critic is not None and "critic" not in state:
        raise CheckpointError(
            f"checkpoint {checkpoint} has no critic state; it was written by a run without a critic"
        )
    if state.get("sharded"):  # an FSDP run's checkpoint: resharded to this run's ranks
        load_sharded_state(os.path.join(checkpoint, state["sharded"]), networks(trainer))
    else:
        load_full_optimizer(trainer.policy, trainer.optimizer, state["optimizer"])
        if critic is not None:
            load_full_optimizer(trainer.critic, critic.optimizer, state["critic"]["optimizer"])
    for _, optimizer in networks(trainer).values():  # a checkpoint may carry another implementation
        fused = optimizer.defaults.get("fused")
        for group in optimizer.param_groups:
            group["fused"] = fused
    trainer.scheduler.load_state_dict(state["scheduler"])
    _load_controllers(trainer, state)
    if critic is not None:
        critic.scheduler.load_state_dict(state["critic"]["scheduler"])
        if critic.step.scaler is not None and state["critic"].get("grad_scaler"):
            critic.step.scaler.load_state_dict(state["critic"]["grad_scaler"])
    _load_loss_scale(trainer, state, checkpoint)
    if trainer.ptx_data is not None:
        trainer.ptx_data.position = state.get("ptx_position", 0)
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])


def _load_controllers(trainer, state: dict[str, Any]) -> None:
    """The KL and entropy coefficients' controllers and the reward normaliser."""
    trainer.kl_ctl.load_state_dict(state["kl_controller"])
    if trainer.entropy_ctl is not None and "entropy_controller" in state:
        trainer.entropy_ctl.load_state_dict(state["entropy_controller"])
        trainer.objective.entropy_coef = trainer.entropy_ctl.value
    if "reward_normalizer" in state:
        trainer.scorer.normalizer.load_state_dict(state["reward_normalizer"])


def _load_loss_scale(trainer, state: dict[str, Any], checkpoint: str) -> None:
    scaler = trainer.policy_step.step.scaler
    if scaler is not None:
        if state.get("grad_scaler"):
            scaler.load_state_dict(state["grad_scaler"])
        else:  # a checkpoint of another precision: the scale starts over
            start = scaler.get_scale()
            log.warning("note: checkpoint %s has no fp16 loss scale; starting from %g", checkpoint, start)
