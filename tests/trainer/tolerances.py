"""How far apart two float32 runs that should compute the same thing may log their metrics, metric
by metric, with the derivation of each bound (tests that compare a 1-process run with a 2-rank
one, a resumed run with a straight one, and so on).

The runs differ only in the order of float32 sums (a rank's partial sums then the all-reduce, a
micro-batch's padding, the kernels one CPU picks over another). A sum of N terms of magnitude M
carries about sqrt(N) * M * 6e-8 (N ~ 500 tokens here: ~1.3e-6 relative) and two AdamW steps carry
that into the weights and every later forward: ``REL`` = 1e-5 bounds the relative gap of a
*plain* quantity, one whose summands do not cancel (a mean of same-signed terms, a norm, a count
or fraction, a rate); ``FLOOR`` = 1e-7 absolute covers values that are 0 up to rounding.

A quantity that is a difference of nearly equal numbers magnifies those relative gaps by its
condition number. Each such metric has its own bound below, built from two assumptions:

- every per-token log-prob ``x_t`` is a plain quantity: it carries at most ``REL * |x_t|`` on
  average over tokens (measured: the mean |trainer - sampler| gap of one forward in two batch
  layouts, ``mismatch/logprob_abs_mean``, is 1-1.7e-6 at |x| ~ 1.7-2.2 on three kernel sets),
  and a single token at most ``REL * max|x|`` of the batch (a log-softmax carries the logits'
  rounding, not its own size: a 0.77-nat token moved 1.1e-5 there; bounds of a maximum over
  tokens use ``lp_max``);
- every per-token advantage ``A_t`` likewise carries at most ``REL * |A_t|``.

and from the conditioning of the batch the reference run trained on (:func:`conditioning`: means
of |log-prob|, |advantage| and their deviations, read by :func:`recording_conditioning` where the
trainer computes ``entropy/cov``). Every metric name of :data:`policygrad.learn.metrics.METRICS`
is classified in :data:`BOUNDS`: a new metric fails :func:`assert_same_metrics` until someone decides
how it is conditioned (tests/trainer/test_tolerances.py checks the table covers every name).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from unittest import mock

import torch

from policygrad.learn.metrics import METRICS
from policygrad.learn.optim import OptimizerStep
from policygrad.trainer import loop

REL = 1e-5
FLOOR = 1e-7

# Wall-clock, throughput and memory readings (and how far the sampler got ahead, a timing): they
# differ between two identical runs and are never compared.
VOLATILE = ("time/", "perf/", "memory/", "async/queue", "async/overlap")


def conditioning(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Float64 statistics over the valid tokens of one step's batch (``logprobs`` [B, T] the
    behaviour log-probs of the sampled tokens, ``advantages`` [B, T], ``mask`` [B, T] nonzero =
    valid): ``lp_abs`` mean |x|, ``lp_rms`` sqrt(mean x^2), ``lp_max`` max |x|, ``adv_abs`` mean
    |A| and ``cov_scale`` mean(|x| |A - mean A| + |x - mean x| |A|)."""
    keep = mask > 0
    x, a = logprobs.double()[keep], advantages.double()[keep]
    dx, da = x - x.mean(), a - a.mean()
    return {
        "lp_abs": float(x.abs().mean()),
        "lp_rms": float(x.square().mean().sqrt()),
        "lp_max": float(x.abs().max()),
        "adv_abs": float(a.abs().mean()),
        "cov_scale": float((x.abs() * da.abs() + dx.abs() * a.abs()).mean()),
    }


def _grads(params) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().double() for p in params]


@contextlib.contextmanager
def recording_conditioning() -> Iterator[list[dict[str, float | None]]]:
    """Within the block, each step of a run in this process appends to the yielded list (one
    entry per step, in order) its batch's :func:`conditioning` (the tensors ``entropy/cov`` is
    computed from) and ``grad_abs`` / ``critic_grad_abs``: the mean over the step's optimizer steps
    (of the policy; of the critic) of sum_m |g_m|, g_m the gradient each backward (a micro-batch)
    added; None when no optimizer step computed a norm."""
    seen: list[dict[str, float | None]] = []
    step_metrics, backward, apply = loop.Trainer.step_metrics, OptimizerStep.backward, OptimizerStep.apply

    def recording_backward(self, loss, **kwargs):
        before = _grads(self.params)
        out = backward(self, loss, **kwargs)
        added = sum(
            float((p.grad.double() - (0.0 if g is None else g)).square().sum())
            for p, g in zip(self.params, before)
            if p.grad is not None
        )
        self._tol_micro = [*getattr(self, "_tol_micro", []), math.sqrt(added)]
        return out

    def recording_apply(self):
        out = apply(self)
        if out.grad_norm is not None:  # the norms UpdateStats averages into optim/grad_norm
            self._tol_steps = [*getattr(self, "_tol_steps", []), sum(getattr(self, "_tol_micro", []))]
        self._tol_micro = []
        return out

    def recording_step_metrics(self, batch, sampled, exp, stats):
        cond: dict[str, float | None] = {}
        if exp.behaviour_logprobs is not None:  # the tokens entropy/cov is computed over
            usable = exp.loss_mask * torch.isfinite(exp.behaviour_logprobs).to(exp.loss_mask)
            cond.update(conditioning(exp.behaviour_logprobs, exp.advantages, usable))
        critic = self.critic_trainer.step if self.critic_trainer is not None else None
        for key, holder in (("grad_abs", self.policy_step.step), ("critic_grad_abs", critic)):
            norms = getattr(holder, "_tol_steps", [])
            cond[key] = sum(norms) / len(norms) if norms else None
            if holder is not None:
                holder._tol_steps = []
        seen.append(cond)
        return step_metrics(self, batch, sampled, exp, stats)

    with (
        mock.patch.object(loop.Trainer, "step_metrics", recording_step_metrics),
        mock.patch.object(OptimizerStep, "backward", recording_backward),
        mock.patch.object(OptimizerStep, "apply", recording_apply),
    ):
        yield seen


# ----------------------------------------------------------------------------- the bounds
# Each takes the reference run's row ``m`` and its batch's conditioning ``c`` and returns the
# absolute gap allowed on top of REL * |value| + FLOOR.


def _plain(_m, _c) -> float:
    return 0.0


def _covariance(_m, c) -> float:
    """entropy/cov = mean((x - mean x)(A - mean A)) over tokens, x the log-prob: to first order
    the gap is mean(dx_t (A_t - mean A) + (x_t - mean x) dA_t) (the means' own gaps multiply a
    deviation whose mean is 0), with |dx_t| <= REL |x_t| and |dA_t| <= REL |A_t|:
    REL * mean(|x| |A - mean A| + |x - mean x| |A|). Relative to |cov| that is the condition number
    cov_scale / |cov|: 1.19 / 0.0076 = 157 at the first step of the distributed tests' grpo case
    (1.2e-5 allowed, gaps of 3e-7 seen on restricted kernels), 1.95 / 0.0287 = 68 at reinforce_pp's
    (2e-5 allowed, a Xeon's gap 9.3e-7, 3.2e-5 relative: over the plain 1e-5)."""
    return REL * c["cov_scale"]


def _k3_mean(m, c, key: str) -> float:
    """A mean of k3 (or k2) over tokens of the log-ratio r = x - x' of two log-probs of the same
    token (policy and reference; policy and old policy): each carries REL |x|, so |dr_t| <=
    2 REL |x_t|. k3(r) = e^-r - 1 + r, k3'(r) = 1 - e^-r ~ r and r^2 ~ 2 k3 for small r (k2:
    exactly), so by Cauchy-Schwarz |d mean k3| <= sqrt(mean r^2) sqrt(mean dr^2) ~
    sqrt(2 k) * 2 REL lp_rms: relative 2 REL lp_rms sqrt(2 / k), large when the KL is small (at
    k = 0.0046 and lp_rms 2.3, vineppo_ahead's step 2: 9.7e-4; a Xeon's gap 5.9e-5, 1.1e-4 with
    ATEN_CPU_CAPABILITY=default). A k1
    loss term (derivative 1) would need 2 REL lp_abs; no test here uses one."""
    return 2 * REL * c["lp_rms"] * math.sqrt(2 * abs(float(m[key])))


def _kl_loss_term(m, c) -> float:
    return _k3_mean(m, c, "kl/loss_term")


def _approx_kl(m, c) -> float:
    return _k3_mean(m, c, "policy/approx_kl")


def _k1_mean(_m, c) -> float:
    """kl/ref and async/behaviour_kl: a mean of k1 = x - x' over tokens, each log-prob carrying
    REL |x|: the gap is at most 2 REL lp_abs absolute, whatever the KL (0 for the unchanged
    policy at step 1, where a relative bound cannot hold)."""
    return 2 * REL * c["lp_abs"]


def _non_score(m, c) -> float:
    """reward/non_score = mean over sequences of the sum over their tokens of -beta k1: each
    sequence's sum carries beta * (its tokens) * 2 REL lp_abs, on average over sequences
    beta * response/length_mean * 2 REL lp_abs (the KL reward is k1, the reward placement's
    default, in every test here). returns/mean likewise: a return sums the KL rewards of the
    tokens after it (and a plain score)."""
    return float(m["kl/coef"]) * float(m["response/length_mean"]) * 2 * REL * c["lp_abs"]


def _advantages_mean(_m, c) -> float:
    """advantages/mean of whitened advantages is 0 up to rounding: a mean of terms of both signs,
    whose gap is REL times the mean of their magnitudes, REL adv_abs."""
    return REL * c["adv_abs"]


def _ratio_rel(c) -> float:
    """The relative gap of a ratio exp(x - x') of two log-probs of one token: 2 REL max|x|."""
    return 2 * REL * c["lp_max"]


def _ratio(m, c, key: str) -> float:
    """policy/ratio_*, mismatch/is_weight_mean: ratios exp(x - x') (and a mean of such positive
    terms) carry the relative gap of :func:`_ratio_rel`."""
    return _ratio_rel(c) * abs(float(m[key]))


def _policy_loss(m, c) -> float:
    """policy/loss = mean(-A_t w_t) (+ beta k3 + the entropy bonus + the positive-example NLL),
    w the (clipped) ratio: the pg part is a sum of terms of both signs (0 up to rounding at ratio 1)
    with gap REL mean|A| w_max (1 + 2 lp_max) (each A_t carries REL, each w_t the ratio's 2 REL
    lp_max); the other terms are plain, REL times their size (the positive-example coefficient
    taken as <= 1, as in every test here)."""
    w = max(1.0, float(m.get("policy/ratio_max", 1.0)))
    pg = c["adv_abs"] * w * (1 + 2 * c["lp_max"])
    others = float(m.get("kl/coef", 0.0)) * abs(float(m.get("kl/loss_term", 0.0)))
    others += abs(float(m.get("entropy/coef", 0.0))) * abs(float(m.get("policy/entropy", 0.0)))
    others += abs(float(m.get("policy/positive_lm_nll", 0.0)))
    return REL * (pg + others)


def _logprob_gap_mean(_m, c) -> float:
    """mismatch/logprob_abs_mean: a mean over tokens of |x - x'|, each carrying 2 REL |x_t|."""
    return 2 * REL * c["lp_abs"]


def _logprob_gap_max(_m, c) -> float:
    """mismatch/logprob_abs_max: one token's |x - x'|, carrying up to 2 REL max|x|."""
    return 2 * REL * c["lp_max"]


def _seq_log_ratio_std(m, c) -> float:
    """mismatch/seq_log_ratio_std: the std over sequences of sum_t (x_t - x'_t); each sum carries
    at most 2 REL lp_max * response/length_max, and a std moves by at most the largest move of
    its inputs."""
    return 2 * REL * c["lp_max"] * float(m["response/length_max"])


def _seq_ratio(m, c, key: str) -> float:
    """mismatch/seq_ratio_*: exp of a sequence's summed log-ratio: relative gap as its std's."""
    return _seq_log_ratio_std(m, c) * abs(float(m[key]))


def _grad_norm(c, key: str) -> float:
    """optim/grad_norm, critic/grad_norm: the mean over optimizer steps of |g|, g = sum_m g_m the
    gradients the step's backwards (micro-batches) added. Each g_m is a plain quantity (REL of
    |g_m|), so |dg| <= REL sum_m |g_m|: the norm has condition number sum_m |g_m| / |g|, large
    when micro-batches of advantages of opposite signs cancel (the distributed tests' micro-batches
    of 2 rows; a single micro-batch gives REL). Measured up to 7.3e-6 relative natively at grad
    norm 12.6, over the 1.3e-6 of a plain sum."""
    return REL * c[key] if c.get(key) is not None else 0.0


def vf_loss_rel(m) -> float:
    """critic/vf_loss = mean(0.5 * (V - R)^2). The residual V - R of values |V| ~ values_mean
    cancels: its relative error is REL * (|V| + |V - R|) / |V - R| with |V - R| ~
    sqrt(2 vf_loss), and the square doubles it (step 1 of the ppo case: values ~0.031, residuals
    ~0.078: 2.8e-5; the runs differ by 8.8e-6)."""
    residual = math.sqrt(max(2 * float(m["critic/vf_loss"]), 1e-30))
    return 2 * REL * (1 + abs(float(m["critic/values_mean"])) / residual)


def _vf_loss(m, _c) -> float:
    return vf_loss_rel(m) * abs(float(m["critic/vf_loss"]))


def _explained_variance(m, _c) -> float:
    """critic/explained_variance = 1 - Var(R - V) / Var(R): the ratio q = 1 - EV carries the
    relative error of its numerator (the residual's, as vf_loss) plus its denominator's (REL), so
    EV may differ by |1 - EV| times their sum (1.72 x 3.8e-5 at step 1 of the ppo case, where
    the runs differ by 7.6e-6); a plain relative tolerance on EV fails as EV nears 0."""
    return abs(1 - float(m["critic/explained_variance"])) * (vf_loss_rel(m) + REL)


# Plain: REL relative + FLOOR. Rewards and scores of the same samples, counts and fractions of
# tokens, groups or episodes, lengths, rates and controller values, means of same-signed terms
# (entropy, NLL, the PPO-ptx loss, values of the tiny critic).
PLAIN = (
    "step",
    "reward/mean",
    "reward/std",
    "reward/score",
    "reward/score_raw_mean",
    "reward/valid_frac",
    "reward/invalid_frac",
    "reward/zero_variance_group_frac",
    "reward_fn/<fn>/mean",
    "reward_fn/<fn>/invalid",
    "dynamic_sampling/groups_sampled",
    "dynamic_sampling/groups_kept",
    "dynamic_sampling/rounds",
    "vineppo/extra_tokens",
    "vineppo/extra_sequences",
    "vineppo/splits_mean",
    "response/length_mean",
    "response/length_max",
    "response/truncated_frac",
    "kl/coef",
    "policy/clipfrac",
    "policy/clipfrac_low",
    "policy/clipfrac_high",
    "policy/clipfrac_dual",
    "policy/entropy",
    "policy/positive_lm_nll",
    "policy/positive_frac",
    "entropy/mean",
    "entropy/coef",
    "entropy/cov_selected_frac",
    "policy/nonfinite_tokens",
    "optim/steps",
    "optim/skipped_nonfinite",
    "optim/skipped_rows_frac",
    "optim/lr",
    "optim/early_stopped",
    "optim/loss_scale",
    "ptx/loss",
    "critic/vf_clipfrac",
    "critic/values_mean",
    "critic/pretraining",
    "critic/steps",
    "critic/skipped_nonfinite",
    "critic/lr",
    "mismatch/is_capped_frac",
    "mismatch/is_floored_frac",
    "async/staleness",
    "eval/accuracy",
    "eval/pass@<k>",
    "eval/maj@<k>",
    "eval/turns_mean",
    "eval/turns_to_success",
    "eval/env/<info>",
    "config/<field>",
    "episode/turns_mean",
    "episode/stop_<reason>",
    "episode/action_tokens_mean",
    "episode/observation_tokens_mean",
    "episode/restarts_mean",
    "env/turn_reward_mean",
    "env/final_reward_mean",
    "env/failed_frac",
    "env/retries",  # counts: exact in either run, the plain bound holds
    "env/groups_dropped",
    "env/close_errors",
    "env/<info>",
)
# Every metric name of METRICS (and "step"): a bound function, or None for the volatile ones,
# never compared (a name under time/, perf/ or memory/ is a wall-clock, throughput or memory
# reading by the naming rule of policygrad/learn/metrics.py, so the prefix classifies it).
# A name in none of these raises in bound_of.
BOUNDS: dict[str, Callable | None] = {
    **{name: _plain for name in PLAIN},
    **{name: None for name in METRICS if name.startswith(VOLATILE) or name == "time/generation_wait_s"},
    "returns/mean": _non_score,
    "entropy/cov": _covariance,
    "kl/loss_term": _kl_loss_term,
    "policy/approx_kl": _approx_kl,
    "kl/ref": _k1_mean,
    "async/behaviour_kl": _k1_mean,
    "reward/non_score": _non_score,
    "advantages/mean": _advantages_mean,
    "policy/loss": _policy_loss,
    "policy/ratio_mean": lambda m, c: _ratio(m, c, "policy/ratio_mean"),
    "policy/ratio_max": lambda m, c: _ratio(m, c, "policy/ratio_max"),
    "mismatch/is_weight_mean": lambda m, c: _ratio(m, c, "mismatch/is_weight_mean"),
    "mismatch/logprob_abs_mean": _logprob_gap_mean,
    "mismatch/logprob_abs_max": _logprob_gap_max,
    "mismatch/seq_log_ratio_std": _seq_log_ratio_std,
    "mismatch/seq_ratio_min": lambda m, c: _seq_ratio(m, c, "mismatch/seq_ratio_min"),
    "mismatch/seq_ratio_max": lambda m, c: _seq_ratio(m, c, "mismatch/seq_ratio_max"),
    "critic/vf_loss": _vf_loss,
    "optim/grad_norm": lambda _m, c: _grad_norm(c, "grad_abs"),
    "critic/grad_norm": lambda _m, c: _grad_norm(c, "critic_grad_abs"),
    "critic/explained_variance": _explained_variance,
}
# "reward_fn/<fn>/mean" matches any component name in place of <fn> (re.escape leaves < > as is)
_TEMPLATES = [
    (re.compile("^" + re.sub(r"<[a-z]+>", ".+", re.escape(n)) + "$"), n) for n in BOUNDS if "<" in n
]


def bound_of(key: str) -> Callable | None:
    """The bound function of metric ``key`` (a ``<fn>``, ``<k>``, ... entry matches any name in its
    place). Raises KeyError for a name :data:`BOUNDS` does not classify."""
    if key in BOUNDS:
        return BOUNDS[key]
    for pattern, name in _TEMPLATES:
        if pattern.match(key):
            return BOUNDS[name]
    raise KeyError(f"metric {key!r} has no tolerance in tests/trainer/tolerances.py: classify it in BOUNDS")


def allowed_gap(key: str, m1: dict, m2: dict, cond: dict) -> float:
    """The absolute gap allowed between ``m1[key]`` and ``m2[key]`` (``m1`` the reference run's row,
    ``cond`` its batch's :func:`conditioning`)."""
    bound = bound_of(key)
    size = max(abs(float(m1[key])), abs(float(m2[key])))
    return REL * size + FLOOR + bound(m1, cond)


def same(a, b, gap: float) -> bool:
    """``a`` and ``b`` within ``gap``; NaN equals NaN, None equals None."""
    if a is None or b is None:
        return a is b
    a, b = float(a), float(b)
    if math.isnan(a) and math.isnan(b):
        return True
    return abs(a - b) <= gap


def assert_same_metrics(rows1: list[dict], rows2: list[dict], conds: list[dict]) -> None:
    """Every step's metrics of two runs agree within their bounds (volatile keys skipped).
    ``rows1`` is the reference run, ``conds`` its steps' :func:`conditioning`."""
    assert len(rows1) == len(rows2) == len(conds), (len(rows1), len(rows2), len(conds))
    for step, (m1, m2, cond) in enumerate(zip(rows1, rows2, conds)):
        assert m1.keys() == m2.keys()
        differ = {}
        for key in m1:
            if bound_of(key) is None:
                continue
            gap = allowed_gap(key, m1, m2, cond) if m1[key] is not None else 0.0
            if not same(m1[key], m2[key], gap):
                differ[key] = (m1[key], m2[key], f"allowed {gap:.2e}")
        assert not differ, f"step {step}: {differ}"
