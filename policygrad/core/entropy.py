"""The entropy mechanism of policy-gradient RL on a softmax policy: the covariance that drives
entropy collapse, the token selections of Clip-Cov and KL-Cov, and an adaptive entropy coefficient.

For a softmax policy trained by policy gradient, the step change of the entropy is, to first
order, minus the covariance over the sampled tokens between the log-probability of a token and
its advantage (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", eq. 4 and Theorem 2): confident tokens with positive advantage lower the
entropy. Per token, the centred product

    cov_t = (log pi(y_t) - mean log pi) * (A_t - mean A)          (means over the valid tokens)

is that covariance's summand; its mean is the batch covariance. Clip-Cov removes the gradient of
a few random tokens whose ``cov_t`` lies in ``[lb, ub]``; KL-Cov adds a KL penalty on the tokens
with the largest ``cov_t`` (Cui et al. 2025, section 5, eqs. 8-9). The losses themselves are
``clip_cov`` and ``kl_cov`` in :mod:`policygrad.core.losses`.
"""

from __future__ import annotations

from typing import Any

import torch

from .checks import as_bool_mask, check_2d, check_floating, check_real, check_same_shape, check_tensor

__all__ = [
    "COVARIANCE_SELECTIONS",
    "AdaptiveEntropyController",
    "check_selection_options",
    "covariance_selection",
    "token_covariance",
]

COVARIANCE_SELECTIONS = ("clip_cov", "kl_cov")
"""The token selections of :func:`covariance_selection`."""


def token_covariance(
    logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *, reduce=None
) -> torch.Tensor:
    """Per-token summands of the covariance between log-prob and advantage (Cui et al. 2025, eq. 4).

    Args:
        logprobs: [B, T] log-probs of the sampled tokens (detached; any floating dtype).
        advantages: [B, T] advantages.
        response_mask: [B, T], nonzero = valid token.
        reduce: None (one process), or a sum over ranks (``reduce(tensor) -> tensor``) so the
            two means are over every rank's valid tokens.

    Returns:
        [B, T] float32 ``(logprobs - mean) * (advantages - mean)``, 0 at masked positions (NaN
        or inf there never leaks). Its mean over the valid tokens is the batch covariance.

    Raises:
        TypeError: an argument is not a tensor. ValueError: shapes differ or are not 2-D.
    """
    logprobs = check_tensor(logprobs, "logprobs")
    check_2d(logprobs, "logprobs")
    check_floating(logprobs, "logprobs")
    check_tensor(advantages, "advantages")
    check_same_shape(logprobs, "logprobs", advantages=advantages, response_mask=response_mask)
    mask = as_bool_mask(logprobs, response_mask, "logprobs", "response_mask")
    with torch.no_grad():
        lp = torch.where(mask, logprobs.detach().float(), 0.0)
        adv = torch.where(mask, advantages.detach().float(), 0.0)
        sums = torch.stack([lp.sum(), adv.sum(), mask.sum().float()]).double()
        if reduce is not None:
            sums = reduce(sums)
        count = max(float(sums[2]), 1.0)
        mean_lp, mean_adv = float(sums[0]) / count, float(sums[1]) / count
        return torch.where(mask, (lp - mean_lp) * (adv - mean_adv), 0.0)


def _uniform_keys(rows: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float64 pseudo-random numbers in [0, 1) that depend only on (row id, position):
    the same token gets the same key whatever batch, micro-batch or rank it sits in."""
    row = rows.to(torch.int64).reshape(-1, 1)
    pos = torch.arange(width, dtype=torch.int64, device=rows.device).reshape(1, -1)
    h = row * 0x9E3779B1 + pos * 0x85EBCA77 + 0x27D4EB2F
    h = h & 0x7FFFFFFF
    for _ in range(3):  # a few rounds of an integer mix (xorshift-multiply), in 31-bit arithmetic
        h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0x7FFFFFFF
        h = ((h ^ (h >> 12)) * 0x297A2D39) & 0x7FFFFFFF
    return h.double() / float(0x80000000)


def check_selection_options(
    mode: str, ratio: float, lb: float = 1.0, ub: float = 5.0
) -> tuple[float, float, float]:
    """Validate :func:`covariance_selection`'s options; returns ``(ratio, lb, ub)`` as floats.

    Raises:
        TypeError: a non-number. ValueError: unknown ``mode`` (lists the valid ones); ``ratio``
        outside [0, 1]; ``lb > ub``.
    """
    if mode not in COVARIANCE_SELECTIONS:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(COVARIANCE_SELECTIONS)}")
    ratio = check_real(ratio, "ratio")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1] (a fraction of the valid tokens), got {ratio}")
    lb, ub = check_real(lb, "lb"), check_real(ub, "ub")
    if lb > ub:
        raise ValueError(f"lb must be <= ub (a covariance band), got lb={lb}, ub={ub}")
    return ratio, lb, ub


def covariance_selection(
    cov: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str,
    ratio: float,
    lb: float = 1.0,
    ub: float = 5.0,
    rows: torch.Tensor | None = None,
    eligible: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tokens Clip-Cov or KL-Cov act on (Cui et al. 2025, section 5).

    With N valid tokens:

    - ``mode="kl_cov"``: the ``floor(ratio * N)`` valid tokens with the largest ``cov`` (eq. 9;
      ties go to the earlier token in row-major order).
    - ``mode="clip_cov"``: ``max(floor(ratio * N), 1)`` tokens (none at ``ratio`` 0) drawn uniformly without
      replacement from the valid (and ``eligible``) tokens with ``lb <= cov <= ub`` (eq. 8), all
      of them when fewer qualify. The draw is a fixed function of each token's (row id, position)
      (``rows``: the row ids, default ``arange(B)``), so a token is chosen or not whatever
      micro-batch or rank it is in.

    Args:
        cov: [B, T] :func:`token_covariance` output.
        response_mask: [B, T], nonzero = valid token.
        mode: one of :data:`COVARIANCE_SELECTIONS`.
        ratio: fraction of the valid tokens to select, in [0, 1] (the paper: 2e-4 for Clip-Cov,
            2e-3 for KL-Cov on a 7B model).
        lb, ub: Clip-Cov's covariance band (the paper: 1 and 5), ``lb <= ub``.
        rows: long [B] row ids keying the random draw (Clip-Cov).
        eligible: [B, T] bool, tokens Clip-Cov may choose (None: every valid token).

    Returns:
        [B, T] bool, True on the selected tokens (never on a masked one).

    Raises:
        TypeError: a non-tensor or non-number argument. ValueError: unknown ``mode`` (lists the
        valid ones); ``ratio`` outside [0, 1]; ``lb > ub``; shapes differ.
    """
    cov = check_tensor(cov, "cov")
    check_2d(cov, "cov")
    check_same_shape(cov, "cov", response_mask=response_mask)
    ratio, lb, ub = check_selection_options(mode, ratio, lb, ub)
    mask = as_bool_mask(cov, response_mask, "cov", "response_mask")
    with torch.no_grad():
        n_valid = int(mask.sum())
        count = int(ratio * n_valid)
        selected = torch.zeros_like(mask)
        finite = mask & torch.isfinite(cov)  # a NaN would sort above every number
        if mode == "kl_cov":
            score = torch.where(finite, cov.double(), -torch.inf).reshape(-1)
            count = min(count, int(finite.sum()))
        else:
            count = max(count, 1) if n_valid and ratio > 0 else 0
            band = finite & (cov >= lb) & (cov <= ub)
            if eligible is not None:
                band = band & eligible
            keys = _uniform_keys(rows if rows is not None else torch.arange(cov.shape[0]), cov.shape[1])
            score = torch.where(band, keys.to(cov.device), -torch.inf).reshape(-1)
            count = min(count, int(band.sum()))
        if count:
            order = torch.sort(score, descending=True, stable=True).indices[:count]
            selected.view(-1)[order] = True
        return selected & mask


class AdaptiveEntropyController:
    """An entropy coefficient that steers the policy's entropy toward a target (He et al. 2025,
    "Skywork Open Reasoner 1 Technical Report", section 3.2.3, adaptive entropy control).

    After a step whose policy had mean token entropy ``entropy``:

        coef <- max(coef + delta, 0)   if entropy < target
        coef <- max(coef - delta, 0)   otherwise

    and the bonus is applied (``.value``) only while the last measured entropy is below the
    target, so a policy above it trains without one. Same interface as the KL controllers.

    Args:
        init_coef: starting coefficient, >= 0 (Skywork-OR1: 0).
        target: target mean entropy per token (nats), > 0 (Skywork-OR1: 0.2).
        delta: change per step, > 0 (Skywork-OR1: 0.005).
        cap: the most the coefficient grows to (default: no cap); :attr:`capped` says it got there
            (a target the policy does not reach would otherwise raise it every step without bound).

    Raises:
        TypeError: an argument is not a number. ValueError: ``init_coef`` < 0, ``target`` <= 0,
        ``delta`` <= 0, or a non-finite value.
    """

    def __init__(self, init_coef: float, target: float, delta: float, cap: float = float("inf")) -> None:
        init_coef, target, delta = (
            check_real(v, n) for v, n in ((init_coef, "init_coef"), (target, "target"), (delta, "delta"))
        )
        if init_coef < 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if target <= 0:
            raise ValueError(f"target must be > 0 (a mean entropy in nats), got {target}")
        if delta <= 0:
            raise ValueError(f"delta must be > 0, got {delta}")
        if not cap >= init_coef:
            raise ValueError(f"cap must be >= init_coef={init_coef}, got {cap}")
        self.coef, self.target, self.delta, self.cap = init_coef, target, delta, float(cap)
        self.active = True  # before any measurement the starting coefficient applies

    @property
    def capped(self) -> bool:
        """The coefficient is at its cap."""
        return self.coef >= self.cap

    @property
    def value(self) -> float:
        """The coefficient of the next step's bonus (0 while the entropy is above the target)."""
        return self.coef if self.active else 0.0

    def update(self, entropy: float) -> float:
        """One controller step from a measured mean entropy; returns the new :attr:`value`.

        Raises:
            TypeError/ValueError: ``entropy`` is not a finite number.
        """
        entropy = check_real(entropy, "entropy")
        below = entropy < self.target
        self.coef = min(max(self.coef + (self.delta if below else -self.delta), 0.0), self.cap)
        self.active = below
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume."""
        return {"coef": self.coef, "target": self.target, "delta": self.delta, "active": self.active}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: a key is missing or holds an invalid value.
        """
        try:
            coef, target, delta, active = (state[k] for k in ("coef", "target", "delta", "active"))
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"invalid entropy controller state {state!r}: needs coef, target, delta, active"
            ) from e
        if not (
            check_real(coef, "coef") >= 0
            and check_real(target, "target") > 0
            and check_real(delta, "delta") > 0
        ):
            raise ValueError(f"invalid entropy controller state: coef {coef}, target {target}, delta {delta}")
        self.coef, self.target, self.delta, self.active = (
            float(coef),
            float(target),
            float(delta),
            bool(active),
        )

    def __repr__(self) -> str:
        return f"AdaptiveEntropyController(coef={self.coef}, target={self.target}, delta={self.delta})"
