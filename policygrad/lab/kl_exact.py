"""The two exact experiments of ``policygrad lab kl-estimators`` (the protocol:
:mod:`policygrad.lab.kl_estimators`): k1/k2/k3 on Gaussian pairs next to their closed forms
(Schulman 2020), and the expected gradient of each KL placement by enumeration over a small
categorical against the gradients of the reverse and forward KL (Tang & Munos 2025)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from policygrad.core.kl import KL_KINDS, kl_estimate, kl_loss, kl_shaped_rewards
from policygrad.core.losses import get_policy_loss
from policygrad.lab.common import (
    check_positive_int,
)

DEFAULT_MUS = (0.1, 0.5, 1.0, 2.0)


# ---------------------------------------------------------------------------------------------- 1. Gaussians


def gaussian_theory(mu: float, kind: str) -> tuple[float, float]:
    """Closed-form ``(bias / KL, std / KL)`` of estimator ``kind`` for q = N(0,1), p = N(mu,1).

    Derivations in the module docstring (x ~ q, log(q/p) = mu^2/2 - mu x).

    Raises:
        ValueError: ``mu`` == 0 (the KL is 0, relative numbers undefined); unknown ``kind``.
    """
    if mu == 0:
        raise ValueError("mu must be != 0: the true KL is 0 and relative bias/std are undefined")
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    kl = mu * mu / 2
    if kind == "k1":
        return 0.0, abs(mu) / kl
    if kind == "k2":
        return mu * mu / 4, math.sqrt(mu**4 / 2 + mu**6 / 4) / kl
    return 0.0, math.sqrt(math.expm1(mu * mu) - mu * mu) / kl


@dataclasses.dataclass
class GaussianRow:
    """One (mu, estimator) line of Schulman's table.

    Fields:
        mu: mean of p; true_kl: ``mu^2 / 2``; kind: k1/k2/k3; n_samples: N.
        bias_rel: ``(mean estimate - KL) / KL``; std_rel: ``std(estimate) / KL``.
        theory_bias_rel, theory_std_rel: the closed forms of :func:`gaussian_theory`.
        frac_negative: share of samples with a negative estimate.
    """

    mu: float
    true_kl: float
    kind: str
    n_samples: int
    bias_rel: float
    std_rel: float
    theory_bias_rel: float
    theory_std_rel: float
    frac_negative: float


def gaussian_kl_table(
    mus: Sequence[float] = DEFAULT_MUS, *, n_samples: int = 1_000_000, seed: int = 0
) -> list[GaussianRow]:
    """Monte Carlo bias and std of k1, k2, k3 relative to the true KL, for each ``mu``.

    The same N draws ``x ~ N(0, 1)`` (float64, ``torch.Generator`` seeded with ``seed``) serve
    every mu; ``logprobs = log q(x)``, ``ref_logprobs = log p(x)`` go through
    :func:`policygrad.core.kl.kl_estimate`.

    Raises:
        ValueError: an empty ``mus`` or a zero mu; ``n_samples`` < 2.
    """
    n_samples = check_positive_int(n_samples, "n_samples", minimum=2)
    if not mus:
        raise ValueError("mus is empty; give at least one distance such as 0.1")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, generator=g, dtype=torch.float64)
    log_q = -0.5 * x.square()  # the shared normaliser cancels in every log-ratio
    rows = []
    for mu in mus:
        mu = float(mu)
        if mu == 0:
            raise ValueError("mu = 0 gives KL = 0; relative bias/std are undefined; drop it")
        log_p = -0.5 * (x - mu).square()
        kl = mu * mu / 2
        for kind in KL_KINDS:
            est = kl_estimate(log_q, log_p, kind)
            tb, ts = gaussian_theory(mu, kind)
            rows.append(
                GaussianRow(
                    mu=mu,
                    true_kl=kl,
                    kind=kind,
                    n_samples=n_samples,
                    bias_rel=float((est.mean() - kl) / kl),
                    std_rel=float(est.std() / kl),
                    theory_bias_rel=tb,
                    theory_std_rel=ts,
                    frac_negative=float((est < 0).double().mean()),
                )
            )
    return rows


# ---------------------------------------------------------------------------------------------- 3. placements


PLACEMENT_THEORY: dict[tuple[str, str], str] = {
    ("reward", "k1"): "reverse KL",
    ("reward", "k2"): "neither",
    ("reward", "k3"): "neither",
    ("loss", "k1"): "zero",
    ("loss", "k2"): "reverse KL",
    ("loss", "k3"): "forward KL",
    ("loss", "w*k3"): "reverse KL",
}
"""What the expected gradient of each (placement, estimator) follows, on-policy, for one categorical
token (Tang & Munos 2025; Shah et al. 2025; Zhang et al. 2025; DeepSeek-V3.2 2025 for ``w*k3``)."""


@dataclasses.dataclass
class PlacementRow:
    """Expected gradient of one KL placement against the true gradients.

    Fields:
        setting: ``near`` (ref logits = pi logits + 0.1 noise) or ``far`` (independent logits).
        placement: ``reward`` or ``loss``; estimator: ``k1``, ``k2``, ``k3`` or ``w*k3``.
        theory: what it should follow (:data:`PLACEMENT_THEORY`); measured: what it follows here
            (``reverse KL`` / ``forward KL`` when the relative error is < 1e-6, ``zero`` when its
            norm is < 1e-12 of the reverse gradient's, else ``neither``).
        cos_reverse, cos_forward: cosine with grad KL(pi||ref) and grad KL(ref||pi) (0 for zero).
        rel_err_reverse, rel_err_forward: ``||g - g_true|| / ||g_true||``.
        grad_norm: ``||g||``.
    """

    setting: str
    placement: str
    estimator: str
    theory: str
    measured: str
    cos_reverse: float
    cos_forward: float
    rel_err_reverse: float
    rel_err_forward: float
    grad_norm: float

    @property
    def matches(self) -> bool:
        """True when the measured divergence is the theory's."""
        return self.measured == self.theory


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = a.norm(), b.norm()
    if na == 0 or nb == 0:
        return 0.0
    return float(a @ b / (na * nb))


def placement_gradients(theta: torch.Tensor, ref_theta: torch.Tensor) -> dict[tuple[str, str], torch.Tensor]:
    """Expected gradient, with respect to the logits ``theta`` [V], of each KL placement.

    The V outcomes are laid out as V rows of one token each (``[V, 1]`` tensors), and every
    expectation over y ~ pi is the exact sum ``sum_y pi(y) * term(y)`` (pi detached as the
    sampling weight):

    - in the reward: ``kl_shaped_rewards(0, log pi, log ref, beta=1, kind)`` is the per-token
      reward ``-k(y)``; the ``vanilla`` policy loss ``-A log pi`` with ``A = -k`` gives the
      score-function gradient ``E[k grad log pi]`` of the penalty;
    - in the loss: ``kl_loss(log pi, log ref, kind)`` differentiated at each y; ``w*k3`` is
      ``kl_loss(..., kind="k3", old_logprobs=log pi detached)``, pi_old = pi.

    Args:
        theta: [V] float64 logits of pi (not modified). ref_theta: [V] logits of the reference.

    Returns:
        ``{(placement, estimator): gradient [V] float64}`` for the keys of :data:`PLACEMENT_THEORY`,
        each the gradient of the quantity the optimiser MINIMISES (the penalty).
    """
    theta = theta.detach().to(torch.float64)
    ref_logp = torch.log_softmax(ref_theta.detach().to(torch.float64), -1)[:, None]
    mask = torch.ones(theta.shape[0], 1, dtype=torch.bool)
    vanilla = get_policy_loss("vanilla")
    out = {}
    for placement, est in PLACEMENT_THEORY:
        th = theta.clone().requires_grad_(True)
        logp = torch.log_softmax(th, -1)[:, None]
        weight = logp.detach().exp()
        if placement == "reward":
            rewards = kl_shaped_rewards(
                torch.zeros(theta.shape[0], dtype=torch.float64),
                logp.detach(),
                ref_logp,
                mask,
                beta=1.0,
                kind=est,
            )
            term, _ = vanilla(logp, logp.detach(), rewards, mask)
        elif est == "w*k3":
            term = kl_loss(logp, ref_logp, mask, kind="k3", old_logprobs=logp.detach())
        else:
            term = kl_loss(logp, ref_logp, mask, kind=est)
        (grad,) = torch.autograd.grad((weight * term).sum(), th)
        out[(placement, est)] = grad
    return out


def true_kl_gradients(theta: torch.Tensor, ref_theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd gradients w.r.t. ``theta`` of ``KL(pi || ref)`` (reverse) and ``KL(ref || pi)``
    (forward), pi = softmax(theta), ref = softmax(ref_theta), exact sums over the V outcomes."""
    th = theta.detach().to(torch.float64).requires_grad_(True)
    logp = torch.log_softmax(th, -1)
    logr = torch.log_softmax(ref_theta.detach().to(torch.float64), -1)
    reverse = (logp.exp() * (logp - logr)).sum()
    forward = (logr.exp() * (logr - logp)).sum()
    (g_rev,) = torch.autograd.grad(reverse, th, retain_graph=True)
    (g_fwd,) = torch.autograd.grad(forward, th)
    return g_rev, g_fwd


def placement_table(*, vocab_size: int = 8, seed: int = 0) -> list[PlacementRow]:
    """The placement table for a ``near`` and a ``far`` reference over a V-outcome categorical.

    Logits ``theta ~ N(0, 1)``; ``near``: ``ref = theta + 0.1 N(0, 1)``; ``far``: ``ref ~ N(0, 1)``
    independent (seeded with ``seed``).

    Raises:
        ValueError: ``vocab_size`` < 3 (with 2 outcomes every gradient is collinear).
    """
    vocab_size = check_positive_int(vocab_size, "vocab_size", minimum=3)
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(vocab_size, generator=g, dtype=torch.float64)
    settings = {
        "near": theta + 0.1 * torch.randn(vocab_size, generator=g, dtype=torch.float64),
        "far": torch.randn(vocab_size, generator=g, dtype=torch.float64),
    }
    rows = []
    for setting, ref_theta in settings.items():
        g_rev, g_fwd = true_kl_gradients(theta, ref_theta)
        for (placement, est), grad in placement_gradients(theta, ref_theta).items():
            err_rev = float((grad - g_rev).norm() / g_rev.norm())
            err_fwd = float((grad - g_fwd).norm() / g_fwd.norm())
            if grad.norm() < 1e-12 * g_rev.norm():
                measured = "zero"
            elif err_rev < 1e-6:
                measured = "reverse KL"
            elif err_fwd < 1e-6:
                measured = "forward KL"
            else:
                measured = "neither"
            rows.append(
                PlacementRow(
                    setting=setting,
                    placement=placement,
                    estimator=est,
                    theory=PLACEMENT_THEORY[(placement, est)],
                    measured=measured,
                    cos_reverse=_cos(grad, g_rev),
                    cos_forward=_cos(grad, g_fwd),
                    rel_err_reverse=err_rev,
                    rel_err_forward=err_fwd,
                    grad_norm=float(grad.norm()),
                )
            )
    return rows
