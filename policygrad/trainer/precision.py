"""Numeric precision of the trained networks: float32 parameters and optimizer state, compute in
bfloat16 through ``torch.autocast`` where that is wanted (``model.precision``).

Why not bf16 weights: AdamW's update of a weight w is about ``lr`` per step, and a bf16 weight of
magnitude |w| can only move in steps of ``|w| * 2**-8``; at lr 1e-6 and |w| ~ 0.02 almost every
update rounds away (measured in issue 13: 2.1 % of the weights changed over 10 steps). The field's
answer (apex/amp O1, accelerate, FSDP's mixed-precision policy) is float32 master weights that the
optimizer steps, and bf16 copies for the matmuls, which is what autocast does per forward.

Modes (``model.precision``):

- ``fp32``: float32 parameters, float32 compute.
- ``bf16-mixed``: float32 parameters, gradients and Adam moments; forwards (sampling with the hf
  engine, old log-probs, the training forwards, the critic) run under ``torch.autocast`` with
  bfloat16 on the model's device type (CUDA, or CPU for tests).
- ``bf16-pure``: bfloat16 parameters stepped directly by AdamW (the old CUDA behaviour). Small
  updates vanish in rounding; an explicit opt-in for memory-bound experiments only.
- ``auto``: ``bf16-mixed`` on a CUDA device that supports bf16, or when ``model.dtype=bfloat16``
  was asked for explicitly; ``fp32`` otherwise (bf16 matmuls are several times slower on CPUs
  without AMX/AVX512-BF16).

The reference is a second copy of the starting policy, so it takes the policy's parameter dtype
and runs under the same autocast: any other precision gives it different log-probs than the
policy's own, and the KL to it is not 0 before the first update. The other frozen networks
(reward models, a vLLM engine) keep ``model.dtype``: they are never stepped, so bf16 weights lose
nothing there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["PRECISIONS", "Precision", "resolve_precision"]

PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16-pure")


@dataclass(frozen=True)
class Precision:
    """A resolved ``model.precision``.

    Attributes:
        name: ``fp32``, ``bf16-mixed`` or ``bf16-pure``.
        param_dtype: dtype of the trained networks' parameters (and so of their gradients and
            AdamW state): float32 except for ``bf16-pure``.
        autocast_dtype: the compute dtype of forwards under autocast, or None (no autocast).
        device_type: ``cuda`` or ``cpu``, the autocast device type.
    """

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    device_type: str

    def autocast(self):
        """A context in which forwards compute in ``autocast_dtype`` (a no-op without one).

        Wrap forwards only, never an optimizer step: autocast caches the bf16 copy of each weight
        until the outermost autocast region exits, and a step inside it would leave that copy stale."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)


def resolve_precision(name: str, device: torch.device, *, model_dtype: str = "auto") -> Precision:
    """The :class:`Precision` of ``model.precision`` on ``device``.

    Args:
        name: one of :data:`PRECISIONS`.
        device: where the policy trains.
        model_dtype: ``model.dtype`` (``auto`` + an explicit ``bfloat16`` resolves to bf16-mixed).

    Raises:
        ValueError: unknown ``name``.
    """
    if name not in PRECISIONS:
        raise ValueError(f"model.precision={name!r} is not valid; choose one of {list(PRECISIONS)}")
    if name == "auto":
        cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        name = "bf16-mixed" if cuda_bf16 or model_dtype == "bfloat16" else "fp32"
    if name == "fp32":
        return Precision(name, torch.float32, None, device.type)
    if name == "bf16-pure":
        return Precision(name, torch.bfloat16, None, device.type)
    return Precision(name, torch.float32, torch.bfloat16, device.type)
