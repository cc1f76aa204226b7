"""``model.gradient_checkpointing``: recomputation as the memory planner's choice.

``true`` turns full gradient checkpointing on when the policy (and critic) are built; ``false``
never; ``auto`` (the default) decides at each policy update, before its first forward, from the
longest micro-batch it is about to run: on when the model states not yet allocated (gradients
and AdamW moments before the first step) plus that micro-batch's saved activations
(:func:`~policygrad.parallel.footprint.activation_bytes_per_token`) and logits exceed 90% of the free
memory of the device (:func:`~policygrad.parallel.footprint.resolve_gradient_checkpointing`). Once on it
stays on, said once on stderr with the numbers; a run whose activations fit never changes, so it
computes exactly what it did before ``auto`` existed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from policygrad.parallel import footprint

__all__ = ["Recompute", "enable_checkpointing", "pending_state_bytes"]

log = logging.getLogger("policygrad")


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Full gradient checkpointing on a transformers model, a peft model around one, or the
    critic (:class:`~policygrad.models.value.ValueModel`: its backbone; adapters on a frozen
    embedding keep a graph through ``enable_input_require_grads``)."""
    backbone = getattr(model, "backbone", None)
    if backbone is not None and not hasattr(model, "gradient_checkpointing_enable"):
        backbone.gradient_checkpointing_enable()
        if not all(p.requires_grad for p in backbone.get_input_embeddings().parameters()):
            backbone.enable_input_require_grads()
        return
    model.gradient_checkpointing_enable()


def pending_state_bytes(params, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the trainable ``params``' state not allocated yet: a gradient (the parameter's
    dtype) while ``grad`` is None, AdamW's two float32 moments while the optimizer has no state."""
    total = 0
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            total += p.numel() * p.element_size()
        if optimizer is None or p not in optimizer.state:
            total += 2 * p.numel() * 4
    return total


class Recompute:
    """The ``auto`` decision of one run (see the module docstring).

    Args:
        models: the policy, and the critic when there is one: all turn on together.
        shape: the policy's :class:`~policygrad.parallel.footprint.ModelShape` (hidden size, layers, MLP
            width, heads, vocabulary).
        precision: ``model.precision`` resolved (a key of ``ACTIVATION_PRECISIONS``).
        device: where the models train.
        states: counts the state bytes not yet allocated (:func:`pending_state_bytes`).
        read_available: free memory of ``device`` (a seam for tests).
    """

    def __init__(
        self,
        models: list[torch.nn.Module],
        shape: footprint.ModelShape,
        *,
        precision: str,
        device: torch.device,
        states: Callable[[], int] = lambda: 0,
        read_available: Callable[[torch.device], int] = footprint.available_memory_bytes,
    ):
        self.models = models
        self.shape = shape
        self.precision = precision
        self.device = device
        self.states = states
        self.read_available = read_available
        self.enabled = False

    def check(self, sequences: int, seq_len: int) -> bool:
        """Turn checkpointing on (once, logged) when a micro-batch of ``sequences`` x ``seq_len``
        padded tokens would not fit without it; returns whether it is on."""
        if self.enabled or sequences * seq_len == 0:
            return self.enabled
        choice = footprint.resolve_gradient_checkpointing(
            "auto",
            state_bytes=self.states(),
            activation_bytes_per_token=footprint.activation_bytes_per_token(
                self.shape, precision=self.precision, seq_len=seq_len
            ),
            logits_bytes_per_token=footprint.logits_bytes_per_token(self.shape, precision=self.precision),
            tokens=sequences * seq_len,
            available_bytes=self.read_available(self.device),
        )
        if choice.enabled:
            for model in self.models:
                enable_checkpointing(model)
            self.enabled = True
            log.warning("note: model.gradient_checkpointing=auto turned recomputation on: %s", choice.why)
        return self.enabled

    @classmethod
    def for_policy(cls, policy, *, precision: str, device: torch.device, **kwargs) -> Recompute | None:
        """A :class:`Recompute` for ``policy``'s architecture, or None (logged at debug level)
        when its config lacks the sizes the estimate needs (then ``auto`` stays off)."""
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        config = getattr(base, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", None)
        hidden = getattr(text, "hidden_size", None)
        shape = footprint.ModelShape(
            params=1,
            vocab_size=getattr(text, "vocab_size", None),
            num_layers=getattr(text, "num_hidden_layers", None),
            hidden_size=hidden,
            intermediate_size=getattr(text, "intermediate_size", None),
            num_heads=heads,
        )
        if not (shape.hidden_size and shape.num_layers and shape.intermediate_size):
            log.debug("model.gradient_checkpointing=auto: no layer sizes in the model's config; left off")
            return None
        return cls([policy], shape, precision=precision, device=device, **kwargs)
