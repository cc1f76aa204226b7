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
- ``fp16-mixed``: float32 parameters, gradients and Adam moments; forwards under ``torch.autocast``
  with float16, and dynamic loss scaling (``torch.amp.GradScaler``): fp16 keeps 10 mantissa bits
  against bf16's 7, so the sampler and the trainer round each other's numbers less (Qi et al.
  2025, "Defeating the Training-Inference Mismatch via FP16"), but its range ends at 65504 and
  small gradients underflow, so the loss is multiplied by a scale before the backward and the
  gradients divided by it before clipping; a step with inf/NaN gradients is skipped and the scale
  halved (:class:`~policygrad.learn.optim.OptimizerStep`). Needs fp16 autocast on the device
  (CUDA; torch's CPU autocast takes float16 too).
- ``auto``: ``bf16-mixed`` on a CUDA device that supports bf16, on a CPU with bf16 dot-product
  instructions (AVX512-BF16 or AMX-BF16, :func:`cpu_has_fast_bf16`), or when
  ``model.dtype=bfloat16`` was asked for explicitly; ``fp32`` otherwise. On CPUs without them
  bf16 matmuls are emulated and several times slower than float32; with them the training
  forward and backward of the bundled model ran 2.2x faster than in float32
  (``benchmarks/levers.py``, the ``precision`` lever).

The output head (``model.lm_head_dtype``): ``float32`` runs the LM head's matmul, and so the
logits and log-probs, in float32 while the body computes under the autocast dtype (ScaleRL,
Khatri et al. 2025, "The Art of Scaling RL Compute": an fp32 head raised the asymptotic reward).
It swaps the head's class for :class:`~policygrad.models.forward.Float32Head` (same weights, same
state dict), for the policy, the reference and the hf engine's copy alike. Under ``fp32`` it
changes nothing (the head already is float32); ``bf16-pure`` holds bf16 head weights, and is
refused with it.

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

from policygrad.config.checks import ConfigError
from policygrad.models.forward import float32_head

__all__ = [
    "HEAD_DTYPES",
    "PRECISIONS",
    "Precision",
    "cpu_has_fast_bf16",
    "resolve_precision",
    "resumed_precision",
    "unsupported_reason",
]

PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16-pure", "fp16-mixed")

HEAD_DTYPES = ("auto", "float32")
"""Valid ``model.lm_head_dtype`` values (None means ``auto``: the head computes as the body)."""


@dataclass(frozen=True)
class Precision:
    """A resolved ``model.precision``.

    Attributes:
        name: ``fp32``, ``bf16-mixed`` or ``bf16-pure``.
        param_dtype: dtype of the trained networks' parameters (and so of their gradients and
            AdamW state): float32 except for ``bf16-pure``.
        autocast_dtype: the compute dtype of forwards under autocast, or None (no autocast).
        device_type: ``cuda`` or ``cpu``, the autocast device type.
        head_dtype: float32 when the LM head computes in float32 under the autocast
            (``model.lm_head_dtype``), else None (the head computes as the body).
        loss_scaling: dynamic loss scaling of the backward (``fp16-mixed``).
    """

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    device_type: str
    head_dtype: torch.dtype | None = None
    loss_scaling: bool = False

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A fresh ``torch.amp.GradScaler`` on ``device_type`` when the precision scales the loss
        (``fp16-mixed``; torch's defaults: initial scale 2**16, halved on an overflow, doubled
        after 2000 clean steps), else None."""
        return torch.amp.GradScaler(self.device_type) if self.loss_scaling else None

    def prepare_head(self, model) -> None:
        """Give ``model`` (a causal LM, peft-wrapped or not; None is ignored) a float32 output
        head when ``head_dtype`` asks for one (:class:`~policygrad.models.forward.Float32Head`);
        nothing otherwise. In place; the weights and the state dict are unchanged.

        Raises:
            ValueError: the model's output head is not a plain ``torch.nn.Linear``."""
        if self.head_dtype is None or model is None:
            return
        float32_head(model)

    def autocast(self):
        """A context in which forwards compute in ``autocast_dtype`` (a no-op without one).

        Wrap forwards only, never an optimizer step: autocast caches the bf16 copy of each weight
        until the outermost autocast region exits, and a step inside it would leave that copy stale."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)


def unsupported_reason(name: str, device: torch.device) -> str | None:
    """Why ``model.precision`` ``name`` cannot run on ``device``, or None when it can.

    fp16-mixed needs float16 autocast on the device type (checked by running one float16 matmul
    under it: CUDA has it, torch's CPU autocast has it since torch 2.x); bf16 on CUDA needs a
    GPU with bfloat16 (Ampere or newer)."""
    if name == "fp16-mixed":
        try:
            with torch.autocast(device.type, dtype=torch.float16):
                x = torch.ones(2, 2, device=device)
                ok = torch.mm(x, x).dtype == torch.float16
        except (RuntimeError, ValueError) as err:  # an autocast device type without float16
            return f"torch.autocast({device.type!r}) has no float16 ({err})"
        return None if ok else f"torch.autocast({device.type!r}) does not compute in float16"
    if name in ("bf16-mixed", "bf16-pure") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bfloat16"
    return None


FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""``/proc/cpuinfo`` flags of x86 instructions that compute bf16 dot products natively."""


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX-BF16 among the
    ``flags`` of ``/proc/cpuinfo``), so ``bf16-mixed`` is faster than float32 on it.

    Args:
        cpuinfo: the text of ``/proc/cpuinfo`` (None: read it; a machine without it, such as
            macOS, gives False).
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return any(flag in value.split() for flag in FAST_BF16_FLAGS)
    return False


def resumed_precision(name: str, saved: str | None) -> tuple[str, bool | None]:
    """``model.precision`` and ``fast_cpu_bf16`` for :func:`resolve_precision` when a run resumes.

    ``auto`` keeps the precision the checkpoint was trained in, whatever this machine would pick:
    a resume on another machine (or after ``auto`` learned to pick bf16-mixed on CPUs with bf16
    instructions) must not switch a float32 run to bf16 compute mid-run. A checkpoint that records
    no precision was written when ``auto`` on a CPU meant float32 (``fast_cpu_bf16=False``).

    Args:
        name: the config's ``model.precision``.
        saved: the resolved precision the checkpoint's trainer state records (None: none).
    """
    if name != "auto":
        return name, None
    if saved in PRECISIONS and saved != "auto":
        return saved, None
    return name, False


def resolve_precision(
    name: str,
    device: torch.device,
    *,
    model_dtype: str = "auto",
    lm_head_dtype: str | None = None,
    fast_cpu_bf16: bool | None = None,
) -> Precision:
    """The :class:`Precision` of ``model.precision`` on ``device``.

    Args:
        name: one of :data:`PRECISIONS`.
        device: where the policy trains.
        model_dtype: ``model.dtype`` (``auto`` + an explicit ``bfloat16`` resolves to bf16-mixed).
        fast_cpu_bf16: whether ``auto`` on a CPU picks ``bf16-mixed`` (None:
            :func:`cpu_has_fast_bf16`).
        lm_head_dtype: ``model.lm_head_dtype``: None / ``auto`` (the head computes as the body)
            or ``float32`` (a float32 head under the autocast; nothing to do without one).

    Raises:
        ValueError: unknown ``name`` or ``lm_head_dtype``; ``fp16-mixed`` on a device without
            float16 autocast; ``lm_head_dtype=float32`` with ``bf16-pure`` (the config's
            ``ConfigError`` is a ValueError).
    """
    if name not in PRECISIONS:
        raise ValueError(f"model.precision={name!r} is not valid; choose one of {list(PRECISIONS)}")
    head = lm_head_dtype or "auto"
    if head not in HEAD_DTYPES:
        raise ValueError(
            f"model.lm_head_dtype={lm_head_dtype!r} is not valid; choose one of {list(HEAD_DTYPES)}"
        )
    if name == "auto":
        if device.type == "cuda":
            fast = torch.cuda.is_bf16_supported()
        elif device.type == "cpu":
            fast = cpu_has_fast_bf16() if fast_cpu_bf16 is None else fast_cpu_bf16
        else:
            fast = False
        name = "bf16-mixed" if fast or model_dtype == "bfloat16" else "fp32"
    if name == "fp32":
        return Precision(name, torch.float32, None, device.type)
    if name == "bf16-pure":
        if head == "float32":
            raise ConfigError(
                "model.lm_head_dtype=float32 with model.precision=bf16-pure: the head's weights are bfloat16 "
                "there; use model.precision=bf16-mixed (float32 weights) or unset model.lm_head_dtype"
            )
        return Precision(name, torch.bfloat16, None, device.type)
    head_dtype = torch.float32 if head == "float32" else None
    if name == "fp16-mixed":
        why = unsupported_reason(name, device)
        if why is not None:
            raise ConfigError(
                f"model.precision=fp16-mixed needs float16 autocast ({why}); use a GPU or bf16-mixed"
            )
        return Precision(name, torch.float32, torch.float16, device.type, head_dtype, loss_scaling=True)
    if head_dtype is None:
        return Precision(name, torch.float32, torch.bfloat16, device.type)
    return Precision(name, torch.float32, torch.bfloat16, device.type, head_dtype)
