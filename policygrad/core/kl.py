"""KL to the reference policy: per-token estimators, KL-shaped rewards, KL loss terms, placements.

The coefficient's controllers are in :mod:`policygrad.core.kl_control` (re-exported here); the
kinds and the placements' declarations in :mod:`policygrad.specs.kl` (torch-free, for the config).

Conventions (Schulman 2020, "Approximating KL divergence"): "reverse KL" is KL(pi || pi_ref),
the one in the RLHF objective; "forward KL" is KL(pi_ref || pi). Samples are tokens drawn from
pi (on-policy) or pi_old. Estimators follow Schulman (2020), "Approximating KL divergence":

- ``k1 = log(pi / pi_ref)``: unbiased for KL(pi || pi_ref), high variance, can be negative.
- ``k2 = 0.5 * log(pi / pi_ref)^2``: biased, low variance, >= 0.
- ``k3 = (r - 1) - log r`` with ``r = pi_ref / pi``: unbiased, low variance when pi ~ pi_ref, >= 0.

Two places to put the KL (or none), each a registered :class:`KLPlacement` (:data:`KL_PLACEMENTS`,
:func:`get_kl_placement`):

- In the reward (:func:`kl_shaped_rewards`, PPO-RLHF): detached, part of the return, so it reaches
  the parameters through the score function; k1 there gives the gradient of the sequence-level
  reverse KL.
- In the loss (:func:`kl_loss`, GRPO): differentiated at the sampled tokens. The expected
  gradient of k1 is 0, of k2 the (per-token) reverse-KL gradient, of k3 the FORWARD-KL gradient.
  Multiplying by ``w = pi / pi_old`` kept in the graph (DeepSeek-V3.2, 2025; Zhang et al. 2025)
  makes k3's expected gradient the reverse-KL gradient.
"""

from __future__ import annotations

import abc

import torch

from policygrad.specs.kl import KL_KINDS, KL_PLACEMENTS, KLPlacementSpec, check_kl_kind, kl_placement_spec

from .checks import as_bool_mask, check_2d, check_real, check_same_shape, check_tensor
from .kl_control import AdaptiveKLController, FixedKLController

__all__ = [
    "KL_KINDS",
    "KL_PLACEMENTS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLPlacement",
    "get_kl_placement",
    "kl_estimate",
    "kl_loss",
    "kl_shaped_rewards",
    "last_token_rewards",
]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token sample estimate of KL(pi || pi_ref) at tokens sampled from pi.

    With ``log_ratio = logprobs - ref_logprobs = log(pi / pi_ref)`` (Schulman 2020,
    "Approximating KL divergence"):

    - ``k1 = log_ratio``
    - ``k2 = 0.5 * log_ratio**2``
    - ``k3 = (r - 1) - log r`` with ``r = pi_ref / pi = exp(-log_ratio)``, computed as
      ``expm1(-log_ratio) + log_ratio`` (exact near r = 1, where k3 is second-order small).

    No clamping: a token with pi << pi_ref gives a large k3 (``r`` is exponential in the
    log-ratio), which is the honest value. Differentiable in both inputs.

    Args:
        logprobs: [B, T] (any shape) log pi of the sampled tokens, floating.
        ref_logprobs: same shape, log pi_ref of the same tokens.
        kind: one of :data:`KL_KINDS`.

    Returns:
        tensor of the inputs' shape and (promoted) dtype. Garbage in masked positions stays
        there: mask the result (as :func:`kl_loss` and :func:`kl_shaped_rewards` do).

    Raises:
        TypeError: an input is not a tensor.
        ValueError: ``ref_logprobs`` shape differs from ``logprobs``; unknown ``kind`` (lists the
            valid ones).
    """
    logprobs = check_tensor(logprobs, "logprobs")
    check_same_shape(logprobs, "logprobs", ref_logprobs=ref_logprobs)
    check_kl_kind(kind)
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(-log_ratio) + log_ratio


def kl_shaped_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    beta: float,
    kind: str = "k1",
) -> torch.Tensor:
    """Per-token rewards of PPO-RLHF: a KL penalty on every token plus the score on the last one.

    ``token_rewards[i, t] = -beta * KL_t`` on every valid token, plus ``scores[i]`` on the last
    valid token of row i; exactly 0 on masked positions (Ziegler et al. 2019; Stiennon et al.
    2020; Ouyang et al. 2022, eq. 2: the per-token k1 sample in the reward gives, through the
    return, the gradient of the sequence-level reverse KL). Detached: the KL here is part of the
    reward, never differentiated.

    Args:
        scores: [B] sequence-level rewards (e.g. reward-model scores).
        logprobs: [B, T] log pi of the sampled tokens (the sampling policy's, at its temperature).
        ref_logprobs: [B, T] log pi_ref of the same tokens.
        response_mask: [B, T], nonzero = valid token.
        beta: KL coefficient, >= 0 (a number or the ``.value`` of a KL controller).
        kind: estimator, one of :data:`KL_KINDS` (``k1`` is the standard choice here).

    Returns:
        [B, T] token rewards, dtype promoted from ``scores`` and ``logprobs``, no gradient.

    Raises:
        TypeError: an input is not a tensor; ``beta`` not a number.
        ValueError: shape mismatch (names the argument: ``scores`` must be [B], the others
            [B, T]); unknown ``kind``; ``beta`` < 0; a row with no valid token (names the rows:
            it has no last token to carry the score).
    """
    logprobs = check_tensor(logprobs, "logprobs")
    check_2d(logprobs, "logprobs")
    check_same_shape(logprobs, "logprobs", ref_logprobs=ref_logprobs, response_mask=response_mask)
    scores = check_tensor(scores, "scores")
    if tuple(scores.shape) != (logprobs.shape[0],):
        raise ValueError(f"scores must have shape [B] = ({logprobs.shape[0]},), got {tuple(scores.shape)}")
    check_kl_kind(kind)
    beta = check_real(beta, "beta")
    if beta < 0:
        raise ValueError(f"beta must be >= 0 (the KL coefficient), got {beta}")
    with torch.no_grad():
        mask = as_bool_mask(logprobs, response_mask, "logprobs", "response_mask")
        last = _last_tokens(mask)
        dtype = torch.promote_types(scores.dtype, torch.promote_types(logprobs.dtype, ref_logprobs.dtype))
        zero = torch.zeros((), dtype=dtype, device=logprobs.device)
        lp = torch.where(mask, logprobs.to(dtype), zero)
        ref = torch.where(mask, ref_logprobs.to(dtype), zero)
        rewards = torch.where(mask, -beta * kl_estimate(lp, ref, kind), zero)
        rows = torch.arange(mask.shape[0], device=mask.device)
        rewards[rows, last] += scores.to(device=rewards.device, dtype=dtype)
        return rewards


def _last_tokens(mask: torch.Tensor) -> torch.Tensor:
    """long [B]: the position of each row's last valid token (``mask`` bool [B, T]).

    Raises:
        ValueError: a row with no valid token (names the rows: it has no last token to carry a score).
    """
    empty = (~mask.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"response_mask has no valid token in row(s) {empty}: the score needs a last valid token"
        )
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, -1).max(dim=-1).values


def last_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards of a sequence-level score alone: ``scores[i]`` on the last valid token of
    row i, exactly 0 elsewhere (the token rewards without a KL penalty, e.g. GRPO with the KL in the
    loss). Detached.

    Args:
        scores: [B] sequence-level rewards.
        response_mask: [B, T], nonzero = valid token.

    Returns:
        [B, T] token rewards in ``scores``' floating dtype (float32 for integer scores), no gradient.

    Raises:
        TypeError: an input is not a tensor. ValueError: ``scores`` not [B] for a [B, T] mask; a row
            with no valid token (names the rows).
    """
    response_mask = check_tensor(response_mask, "response_mask")
    check_2d(response_mask, "response_mask")
    scores = check_tensor(scores, "scores")
    if tuple(scores.shape) != (response_mask.shape[0],):
        raise ValueError(
            f"scores must have shape [B] = ({response_mask.shape[0]},), got {tuple(scores.shape)}"
        )
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    with torch.no_grad():
        mask = as_bool_mask(response_mask, response_mask, "response_mask", "response_mask")
        rewards = torch.zeros(mask.shape, dtype=dtype, device=response_mask.device)
        rows = torch.arange(mask.shape[0], device=mask.device)
        rewards[rows, _last_tokens(mask)] = scores.to(device=rewards.device, dtype=dtype)
        return rewards


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kind: str = "k3",
    old_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL term for the loss (GRPO-style), optionally importance-weighted.

    ``loss[i, t] = KL_kind(logprobs, ref_logprobs)`` on valid tokens, 0 on masked positions
    (Shao et al. 2024, DeepSeekMath, eq. 4, with k3). Differentiated through ``logprobs``;
    ``ref_logprobs`` is treated as a constant (detached).

    Expected gradient, for tokens sampled from pi, of the estimators of Schulman 2020: k1 -> 0;
    k2 -> the per-token reverse-KL gradient; k3 -> the forward-KL gradient grad KL(pi_ref || pi).
    With ``old_logprobs`` the term is ``w * KL`` with ``w = exp(logprobs - old_logprobs)`` =
    pi/pi_old kept in the graph (``old_logprobs`` detached), the correction of DeepSeek-V3.2 (2025) and
    Zhang et al. (2025): ``grad(w k3) = w log(pi/pi_ref) grad log pi``, whose expectation under
    pi_old is the reverse-KL gradient, also on-policy where ``w == 1`` numerically. Reduce the
    result with ``masking.aggregate`` and multiply by beta.

    Args:
        logprobs: [B, T] log pi of the sampled tokens, with gradient.
        ref_logprobs: [B, T] log pi_ref of the same tokens.
        response_mask: [B, T], nonzero = valid token.
        kind: one of :data:`KL_KINDS`; default ``k3``.
        old_logprobs: [B, T] log pi_old (the policy that sampled), or None for no weight.

    Returns:
        [B, T] per-token KL term in ``logprobs``' (promoted) dtype; exactly 0 at masked
        positions, and NaN/inf there reach neither the value nor the gradient.

    Raises:
        TypeError: an input is not a tensor.
        ValueError: shape mismatch (names the argument); unknown ``kind`` (lists the valid ones).
    """
    logprobs = check_tensor(logprobs, "logprobs")
    check_same_shape(
        logprobs,
        "logprobs",
        ref_logprobs=ref_logprobs,
        response_mask=response_mask,
        old_logprobs=old_logprobs,
    )
    check_kl_kind(kind)
    mask = as_bool_mask(logprobs, response_mask, "logprobs", "response_mask")
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    lp = torch.where(mask, logprobs, zero)
    ref = torch.where(mask, ref_logprobs.detach().to(logprobs.dtype), zero)
    term = kl_estimate(lp, ref, kind)
    if old_logprobs is not None:
        old = torch.where(mask, old_logprobs.detach().to(logprobs.dtype), zero)
        term = torch.exp(lp - old) * term
    return torch.where(mask, term, zero)


# ----------------------------------------------------------------------------------------------
# Placements: where the KL enters the objective.


class KLPlacement(abc.ABC):
    """Where the KL to the reference policy enters the objective: a registered capability.

    The trainer asks the placement, never its name: ``needs_reference`` says whether reference
    log-probs must be computed, :meth:`token_rewards` builds the per-token rewards (with or
    without a KL penalty) and :meth:`loss_term` the per-token KL term of the loss (or None).
    Get the registered instances with :func:`get_kl_placement`; the names are
    :data:`KL_PLACEMENTS`.

    Attributes (from the placement's declaration, a
    :class:`~policygrad.specs.kl.KLPlacementSpec` of the same name):
        name: the registry key (``kl.placement`` in the config).
        needs_reference: the placement reads ``ref_logprobs`` (a reference model is needed).
        shapes_rewards: the per-token rewards read the behaviour log-probs (a KL penalty in the
            reward), so those must be the trainer's own log-probs of the sampled tokens.
        default_kind: the estimator used when the config leaves ``kl.kind`` unset (k1 in the
            reward, Ziegler et al. 2019; k3 in the loss, Shao et al. 2024, eq. 4).
    """

    def __init__(self, spec: KLPlacementSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.needs_reference = spec.needs_reference
        self.shapes_rewards = spec.shapes_rewards
        self.default_kind = spec.default_kind

    @abc.abstractmethod
    def token_rewards(
        self,
        scores: torch.Tensor,
        logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        response_mask: torch.Tensor,
        *,
        beta: float,
        kind: str,
    ) -> torch.Tensor:
        """[B, T] per-token rewards: ``scores[B]`` on each row's last valid token, plus the
        per-token KL penalty when the KL is in the reward; see :func:`kl_shaped_rewards`.

        Args:
            scores: [B] sequence-level rewards.
            logprobs: [B, T] log-probs of the sampled tokens under the sampling policy.
            ref_logprobs: [B, T] reference log-probs, or None when ``needs_reference`` is False.
            response_mask: [B, T], nonzero = valid token.
            beta: KL coefficient >= 0 (unused where the KL is not in the reward).
            kind: one of :data:`KL_KINDS` (unused where the KL is not in the reward).

        Raises:
            ValueError / TypeError: as :func:`kl_shaped_rewards`; ``ref_logprobs`` None where
                the placement needs it.
        """

    @abc.abstractmethod
    def loss_term(
        self,
        logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        response_mask: torch.Tensor,
        *,
        kind: str,
        old_logprobs: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """[B, T] per-token KL term to add (times beta) to the loss, or None when the KL is not
        in the loss; see :func:`kl_loss`.

        Args:
            logprobs: [B, T] log pi of the sampled tokens, with gradient.
            ref_logprobs: [B, T] reference log-probs (None allowed where the result is None).
            response_mask: [B, T], nonzero = valid token.
            kind: one of :data:`KL_KINDS`.
            old_logprobs: [B, T] log pi_old for the importance-weighted term, or None.

        Raises:
            ValueError / TypeError: as :func:`kl_loss`; ``ref_logprobs`` None where needed.
        """

    def __repr__(self) -> str:
        return f"KLPlacement({self.name!r})"


def _require_reference(placement: KLPlacement, ref_logprobs: torch.Tensor | None) -> torch.Tensor:
    if ref_logprobs is None:
        raise ValueError(
            f"KL placement {placement.name!r} needs ref_logprobs [B, T] (the reference model's "
            "log-probs of the sampled tokens), got None"
        )
    return ref_logprobs


class _NoKL(KLPlacement):
    """No KL: no reference model; the token rewards carry the score only."""

    def token_rewards(self, scores, logprobs, ref_logprobs, response_mask, *, beta, kind):  # noqa: ARG002 (the KLPlacement interface)
        return last_token_rewards(scores, response_mask)

    def loss_term(self, logprobs, ref_logprobs, response_mask, *, kind, old_logprobs):  # noqa: ARG002 (the KLPlacement interface)
        return None


class _KLInReward(KLPlacement):
    """Per-token ``-beta * KL`` in the reward (PPO-RLHF: Ziegler et al. 2019; Ouyang et al. 2022)."""

    def token_rewards(self, scores, logprobs, ref_logprobs, response_mask, *, beta, kind):
        ref_logprobs = _require_reference(self, ref_logprobs)
        return kl_shaped_rewards(scores, logprobs, ref_logprobs, response_mask, beta=beta, kind=kind)

    def loss_term(self, logprobs, ref_logprobs, response_mask, *, kind, old_logprobs):  # noqa: ARG002 (the KLPlacement interface)
        return None


class _KLInLoss(KLPlacement):
    """A per-token KL term in the loss (GRPO: Shao et al. 2024, eq. 3-4, with k3)."""

    def token_rewards(self, scores, logprobs, ref_logprobs, response_mask, *, beta, kind):  # noqa: ARG002 (the KLPlacement interface)
        return last_token_rewards(scores, response_mask)

    def loss_term(self, logprobs, ref_logprobs, response_mask, *, kind, old_logprobs):
        ref_logprobs = _require_reference(self, ref_logprobs)
        return kl_loss(logprobs, ref_logprobs, response_mask, kind=kind, old_logprobs=old_logprobs)


_PLACEMENTS: dict[str, KLPlacement] = {
    name: implementation(kl_placement_spec(name))
    for name, implementation in (("none", _NoKL), ("reward", _KLInReward), ("loss", _KLInLoss))
}


def get_kl_placement(name: str) -> KLPlacement:
    """The registered :class:`KLPlacement` called ``name``.

    Raises:
        ValueError: unknown name (the message lists :data:`KL_PLACEMENTS`).
    """
    return _PLACEMENTS[kl_placement_spec(name).name]
