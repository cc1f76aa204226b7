"""How noisy is the gradient of each advantage estimator? (``policygrad lab gradient-snr``)

The gradient-quality measurement of Ilyas et al. 2018 ("A Closer Look at Deep Policy Gradients",
which compares sampled gradients with a many-sample reference gradient), applied to the advantage
estimators of this package: hold a checkpoint fixed, draw many independent batches, compute the
policy gradient with each candidate advantage estimator, and measure

- the cosine similarity of each batch's gradient with a high-sample reference gradient, and
- the gradient signal-to-noise ratio ``SNR = ||E g||^2 / E||g - E g||^2``.

Protocol (all estimators at matched numbers of samples):

1. Every draw samples ``samples_per_prompt`` (S) responses for each of the prompts with
   :class:`~policygrad.rollout.hf.HFRolloutEngine` (its own seed per draw) and scores them; a
   constant ``reward_offset`` c can be added to every reward. Because ``E[grad log p] = 0`` the
   offset leaves the expected gradient unchanged, but it adds about ``c^2 E||grad log p||^2`` to
   the variance without a baseline and nothing with a baseline that absorbs constants (a group
   mean, a fitted critic): the reason for the baseline of Williams 1992 (Greensmith et al. 2004,
   "Variance Reduction Techniques for Gradient Estimates in Reinforcement Learning").
2. The same B = prompts x S samples feed every estimator; only the grouping differs:
   ``no-baseline`` is REINFORCE with baseline 0; ``rloo(k=K)`` splits each prompt's S samples into
   S/K groups of K (RLOO's leave-one-out baseline inside each group); ``grpo`` uses the S samples
   of a prompt as one group (mean and std); ``gae(lam=L)`` uses a critic's values
   (``gamma = 1``). Advantages come from the core registry
   (:func:`policygrad.core.advantages.estimate_advantages`).
3. The gradient of each estimator is that of the REINFORCE surrogate ``vanilla`` policy loss
   (:mod:`policygrad.core.losses`) reduced with ``seq-mean-token-sum`` (Williams 1992's REINFORCE
   estimator ``(1/B) sum_i sum_t A_it grad log pi(y_it)``), with respect to a chosen subset of
   the parameters (default: the last decoder layer), from one forward pass
   (:func:`policygrad.models.forward.policy_logprobs`) and one backward pass per estimator (the
   backward through the output head is shared when the head is not measured:
   :func:`estimator_gradients`). The reported vector is the ascent direction (minus the loss
   gradient).
4. The reference gradient is the mean of the ``rloo(k=S)`` gradient over ``reference_draws``
   separate draws (unbiased; the reference's own SNR is reported so its quality can be judged).

Statistics over the M draws of an estimator (``m`` = mean gradient):
``noise = sum_j ||g_j - m||^2 / (M - 1)``; ``SNR = (||m||^2 - noise / M) / noise`` (the
``noise / M`` term removes the bias of ``||m||^2`` as an estimate of ``||E g||^2``; clipped at 0);
``snr_raw = ||m||^2 / noise``; ``cos_ref`` = mean over draws of ``cos(g_j, g_ref)``;
``cos_mean_ref = cos(m, g_ref)`` (the direction of the estimator's mean: below 1 for a biased
estimator such as GRPO's std-normalised one).

The critic (for GAE) is a linear value head on the frozen model's final hidden states (the input
of the output head at each response position, i.e. the state before each token), fit by ridge
least squares (penalty chosen on held-out sequences, :class:`LinearCritic`) to the Monte Carlo
returns (gamma = 1: the sequence's reward at every token) of ``critic_draws`` separate draws.
Its explained variance on the fit draws and on the estimation draws is reported
(:func:`policygrad.core.explained_variance`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from policygrad.core.advantages import estimate_advantages
from policygrad.core.diagnostics import explained_variance
from policygrad.core.kl import last_token_rewards
from policygrad.core.losses import get_policy_loss
from policygrad.core.masking import aggregate
from policygrad.data.sources import resolve_dataset
from policygrad.lab.common import (
    DEFAULT_OUTPUT_DIR,
    OneLineArgumentParser,
    add_run_args,
    check_output_dir,
    check_positive_int,
    check_temperature,
    ensure_output_dir,
    format_table,
    load_lab_model,
    pyplot,
    repeat_each,
    save_figure,
    set_threads,
    tokenize_user_prompts,
    write_json,
)
from policygrad.models.forward import policy_logprobs
from policygrad.rewards.verifiers import answer_correctness
from policygrad.rollout.base import decode_completions
from policygrad.rollout.hf import HFRolloutEngine

DEFAULT_ESTIMATORS = "none,rloo2,rloo4,rloo8,grpo,gae0,gae0.5,gae0.95,gae1"
RewardFn = Callable[..., Sequence[float]]


# ---------------------------------------------------------------------------------------------- estimators


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """One candidate estimator.

    Fields:
        name: display name (``no-baseline``, ``rloo(k=4)``, ``grpo``, ``gae(lam=0.95)``).
        kind: ``none``, ``rloo``, ``grpo`` or ``gae``.
        k: group size for ``rloo`` (``grpo`` uses all samples of a prompt; 0 otherwise).
        lam: GAE lambda (``gae`` only).
    """

    name: str
    kind: str
    k: int = 0
    lam: float = 0.0


def parse_estimators(text: str | Sequence[str]) -> list[EstimatorSpec]:
    """``"none,rloo4,grpo,gae0.95"`` -> specs. Items: ``none`` (or ``no-baseline``), ``rlooK``
    (K >= 2), ``grpo``, ``gaeL`` (0 <= L <= 1).

    Raises:
        ValueError: an unknown item (lists the accepted forms), K < 2, L outside [0, 1], a
            duplicate, or an empty list.
    """
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else [str(t).strip() for t in text]
    items = [t for t in items if t]
    if not items:
        raise ValueError(f"--estimators is empty; e.g. {DEFAULT_ESTIMATORS}")
    specs: list[EstimatorSpec] = []
    for item in items:
        low = item.lower()
        if low in ("none", "no-baseline", "reinforce"):
            spec = EstimatorSpec("no-baseline", "none")
        elif low == "grpo":
            spec = EstimatorSpec("grpo", "grpo")
        elif m := re.fullmatch(r"rloo(?:\(k=)?(\d+)\)?", low):
            k = int(m.group(1))
            if k < 2:
                raise ValueError(f"--estimators: {item!r}: RLOO needs k >= 2 samples per group")
            spec = EstimatorSpec(f"rloo(k={k})", "rloo", k=k)
        elif m := re.fullmatch(r"gae(?:\(lam=)?([0-9.]+)\)?", low):
            try:
                lam = float(m.group(1))
            except ValueError:
                raise ValueError(f"--estimators: {item!r}: lambda is not a number") from None
            if not 0.0 <= lam <= 1.0:
                raise ValueError(f"--estimators: {item!r}: lambda must be in [0, 1]")
            spec = EstimatorSpec(f"gae(lam={lam:g})", "gae", lam=lam)
        else:
            raise ValueError(
                f"--estimators: unknown estimator {item!r}; use none, rlooK (e.g. rloo4), grpo or gaeL "
                "(e.g. gae0.95)"
            )
        if spec in specs:
            raise ValueError(f"--estimators: {spec.name} is listed twice")
        specs.append(spec)
    return specs


def estimator_group_index(batch: int, samples_per_prompt: int, k: int, device) -> torch.Tensor:
    """Row r (prompt r // S, sample r % S) -> group ``(r // S) * (S // k) + (r % S) // k``."""
    rows = torch.arange(batch, device=device)
    return (rows // samples_per_prompt) * (samples_per_prompt // k) + (rows % samples_per_prompt) // k


def estimator_advantages(
    spec: EstimatorSpec,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    samples_per_prompt: int,
    values: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages [B, T] of ``spec`` from the core registry (rows of one prompt contiguous).

    Raises:
        ValueError: ``samples_per_prompt`` not a multiple of an RLOO group size; GAE without values.
    """
    batch = token_rewards.shape[0]
    device = token_rewards.device
    if spec.kind == "none":
        gi = estimator_group_index(batch, samples_per_prompt, samples_per_prompt, device)
        adv, _ = estimate_advantages("reinforce", token_rewards, response_mask, group_index=gi, baseline=0.0)
    elif spec.kind == "rloo":
        gi = estimator_group_index(batch, samples_per_prompt, spec.k, device)
        adv, _ = estimate_advantages("rloo", token_rewards, response_mask, group_index=gi)
    elif spec.kind == "grpo":
        gi = estimator_group_index(batch, samples_per_prompt, samples_per_prompt, device)
        adv, _ = estimate_advantages("grpo", token_rewards, response_mask, group_index=gi, scale="group")
    else:
        if values is None:
            raise ValueError(f"{spec.name} needs critic values")
        gi = estimator_group_index(batch, samples_per_prompt, samples_per_prompt, device)
        adv, _ = estimate_advantages(
            "gae", token_rewards, response_mask, group_index=gi, values=values, gamma=1.0, lam=spec.lam
        )
    return adv


# ---------------------------------------------------------------------------------------------- parameters


def parameter_pattern(subset: str) -> re.Pattern | None:
    """``--params`` checked without a model: None for ``all``, ``lm-head``, ``last-layer``, else
    the compiled regular expression.

    Raises:
        ValueError: not a valid regular expression (names ``--params``).
    """
    if subset in ("all", "lm-head", "last-layer"):
        return None
    try:
        return re.compile(subset)
    except re.error as e:
        raise ValueError(f"--params {subset!r} is not a valid regular expression ({e})") from None


def select_parameters(model: torch.nn.Module, subset: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters whose gradient is measured.

    Args:
        subset: ``last-layer`` (every parameter of the highest-numbered ``layers.N.`` block),
            ``lm-head`` (the output head's weight; with tied embeddings this is the embedding
            matrix, and the backward pass then runs through the whole model), ``all``, or a
            regular expression matched (``re.search``) against parameter names.

    Returns:
        ``[(name, parameter)]`` in model order, tied tensors once.

    Raises:
        ValueError: nothing matches (the message shows some parameter names); a bad regex.
    """
    named = list(model.named_parameters())
    if subset == "all":
        return named
    if subset == "lm-head":
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError("--params lm-head: this model has no output embeddings; use last-layer")
        return [(n, p) for n, p in named if p is head.weight]
    if subset == "last-layer":
        layer_ids = [int(m.group(1)) for n, _ in named if (m := re.search(r"layers\.(\d+)\.", n))]
        if not layer_ids:
            raise ValueError("--params last-layer: no 'layers.N.' parameters in this model; give a regex")
        last = f"layers.{max(layer_ids)}."
        return [(n, p) for n, p in named if last in n]
    pattern = parameter_pattern(subset)
    chosen = [(n, p) for n, p in named if pattern.search(n)]
    if not chosen:
        examples = ", ".join(n for n, _ in named[:4])
        raise ValueError(
            f"--params {subset!r} matches no parameter; use last-layer, lm-head, all, or a regex on names "
            f"such as: {examples}, ..."
        )
    return chosen


# ---------------------------------------------------------------------------------------------- critic


class _HeadInput:
    """Forward pre-hook on the output head that keeps its input: the final hidden states at the
    positions whose logits are computed ([B, T, H] for :func:`response_logits`), still in the
    autograd graph."""

    def __init__(self, model):
        self.value: torch.Tensor | None = None
        self.handle = model.get_output_embeddings().register_forward_pre_hook(self)

    def __call__(self, _module, args):  # torch's forward pre-hook signature
        self.value = args[0]

    def remove(self):
        self.handle.remove()


def _whole_row_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """[B, T] float32 log-probs at ``temperature`` from one plain forward over whole rows through
    the lm_head module (no prompt sharing, no fused head), so a :class:`_HeadInput` hook sees the
    final hidden state of every response position."""
    logprobs, _ = policy_logprobs(
        model, rollout, temperature=temperature, top_k=0, top_p=1.0, share_prompts=False, fused_head=False
    )
    return logprobs


RIDGE_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
"""Ridge penalties (relative to the mean diagonal of X^T X) tried by :meth:`LinearCritic.fit`."""


def _ridge_solve(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """``argmin_w ||x w - y||^2 + ridge * mean(diag(x^T x)) * ||w[:-1]||^2`` (the last column, the
    bias, unpenalised), float64."""
    gram = x.T @ x
    eye = torch.eye(x.shape[1], dtype=torch.float64)
    eye[-1, -1] = 0.0
    return torch.linalg.solve(gram + ridge * gram.diagonal().mean() * eye, x.T @ y)


class LinearCritic:
    """``V(s_t) = w . h_t + b`` on the frozen model's final hidden states, fit by ridge least squares.

    Args:
        ridge: penalty relative to the mean diagonal of ``X^T X`` (the bias is not penalised);
            None (default) picks it from :data:`RIDGE_GRID` by the squared error on held-out
            sequences when :meth:`fit` gets ``groups`` (1e-2 otherwise).

    Attributes:
        chosen_ridge: the penalty of the final fit.
    """

    def __init__(self, ridge: float | None = None):
        self.ridge = ridge
        self.chosen_ridge: float | None = None
        self.weight: torch.Tensor | None = None

    def fit(
        self, features: torch.Tensor, targets: torch.Tensor, groups: torch.Tensor | None = None
    ) -> LinearCritic:
        """Fit on ``features`` [N, H] and ``targets`` [N] (float64 solve). Returns self.

        Args:
            groups: [N] sequence id of each token. With ``ridge=None`` and at least 4 sequences,
                every other sequence (in id order) is held out to choose the penalty, then the
                critic is refit on all tokens. Tokens of one sequence are never split (they are
                strongly correlated).

        Raises:
            ValueError: fewer than 2 rows; ``groups`` of the wrong shape.
        """
        n = features.shape[0]
        if n < 2:
            raise ValueError("the critic needs at least 2 training tokens")
        x = torch.cat([features.double(), torch.ones(n, 1, dtype=torch.float64)], 1)
        y = targets.double()
        ridge = self.ridge
        if ridge is None:
            ridge = 1e-2
            if groups is not None:
                if groups.shape != (n,):
                    raise ValueError(f"groups must have shape [N] = ({n},), got {tuple(groups.shape)}")
                ids, rank = torch.unique(groups, return_inverse=True)
                if ids.numel() >= 4:
                    held = rank % 2 == 1
                    errors = []
                    for r in RIDGE_GRID:
                        w = _ridge_solve(x[~held], y[~held], r)
                        errors.append(float((x[held] @ w - y[held]).square().mean()))
                    ridge = RIDGE_GRID[min(range(len(errors)), key=errors.__getitem__)]
        self.chosen_ridge = ridge
        self.weight = _ridge_solve(x, y, ridge)
        return self

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """Values for ``features`` [..., H] -> [...] float32.

        Raises:
            RuntimeError: called before :meth:`fit`.
        """
        if self.weight is None:
            raise RuntimeError("LinearCritic.predict before fit")
        w = self.weight
        return (features.double() @ w[:-1] + w[-1]).float()


def estimator_gradients(
    model,
    rollout,
    token_rewards: torch.Tensor,
    specs: Sequence[EstimatorSpec],
    tensors: Sequence[torch.Tensor],
    *,
    samples_per_prompt: int,
    temperature: float = 1.0,
    critic: LinearCritic | None = None,
    shared_head_backward: bool | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The policy gradient of each estimator on one rollout, flattened over ``tensors``.

    One forward pass (:func:`policygrad.models.forward.policy_logprobs`, full softmax at
    ``temperature``); for each spec the advantages (:func:`estimator_advantages`), the ``vanilla``
    loss reduced with ``seq-mean-token-sum``, and its gradient.

    Shared head backward (the default whenever the output head's weight is not in ``tensors``):
    the loss is linear in the log-probs and log-prob (b, t) depends on the head's input h only
    through h[b, t], so one backward of ``sum(logprobs)`` to h gives every
    ``J[b, t] = d logprob[b, t] / d h[b, t]``, and each estimator's gradient is the backward of h
    alone with ``grad_outputs = dL/dlogprobs * J``. Exact (the chain rule, reordered), and the
    [B, T, V] backward through the head runs once instead of once per estimator.

    Args:
        model: the causal LM; ``tensors`` must require grad, the rest may not.
        rollout: a :class:`~policygrad.rollout.base.Rollout`.
        token_rewards: [B, T] rewards (score on the last valid token).
        specs: the estimators.
        tensors: the parameters whose gradient is returned.
        samples_per_prompt: S (rows of one prompt contiguous).
        temperature: the sampling temperature.
        critic: values for GAE, from the head's input at each response position.
        shared_head_backward: force (True) or forbid (False) the shared head backward; None = auto.

    Returns:
        ``(gradients, values)``: one float64 vector per spec (the ascent direction, minus the loss
        gradient), and the critic's values [B, T] (None without a critic).

    Raises:
        ValueError: ``shared_head_backward=True`` while the head's weight is in ``tensors``.
    """

    head = model.get_output_embeddings()
    head_measured = head is None or any(p is head.weight for p in tensors)
    if shared_head_backward is None:
        shared_head_backward = not head_measured
    elif shared_head_backward and head_measured:
        raise ValueError(
            "shared_head_backward=True needs the output head's weight outside the measured tensors"
        )
    vanilla = get_policy_loss("vanilla")
    mask = rollout.response_mask
    hook = _HeadInput(model) if (critic is not None or shared_head_backward) else None
    try:
        with torch.enable_grad():
            # One forward over whole rows: the hook reads the lm_head input of every position.
            logprobs = _whole_row_logprobs(model, rollout, temperature)
    finally:
        if hook is not None:
            hook.remove()
    values = critic.predict(hook.value.detach()) if critic is not None else None
    if shared_head_backward:
        hidden = hook.value
        (jac,) = torch.autograd.grad(
            logprobs, hidden, grad_outputs=torch.ones_like(logprobs), retain_graph=True
        )
    out = []
    for i, spec in enumerate(specs):
        adv = estimator_advantages(
            spec, token_rewards, mask, samples_per_prompt=samples_per_prompt, values=values
        )
        loss_matrix, _ = vanilla(logprobs, logprobs.detach(), adv, mask)
        loss = aggregate(loss_matrix, mask, "seq-mean-token-sum")
        retain = i + 1 < len(specs)
        if shared_head_backward:
            (d_logprobs,) = torch.autograd.grad(loss, logprobs, retain_graph=True)
            grads = torch.autograd.grad(
                hidden,
                list(tensors),
                grad_outputs=d_logprobs[..., None] * jac,
                retain_graph=retain,
                allow_unused=True,
            )
        else:
            grads = torch.autograd.grad(loss, list(tensors), retain_graph=retain, allow_unused=True)
        flat = torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                for g, p in zip(grads, tensors)
            ]
        )
        out.append(-flat)
    return out, values


# ---------------------------------------------------------------------------------------------- result


@dataclasses.dataclass
class EstimatorStats:
    """One estimator's numbers over M draws.

    Fields:
        name: estimator; draws: M; samples_per_batch: B (same for all estimators).
        snr: bias-corrected ``||E g||^2 / E||g - E g||^2`` (>= 0); snr_raw: ``||m||^2 / noise``.
        cos_ref: mean over draws of ``cos(g_j, g_ref)``; cos_mean_ref: ``cos(mean g, g_ref)``.
        grad_norm: mean ``||g_j||``; noise: ``E||g - E g||^2``.
    """

    name: str
    draws: int
    samples_per_batch: int
    snr: float
    snr_raw: float
    cos_ref: float
    cos_mean_ref: float
    grad_norm: float
    noise: float


@dataclasses.dataclass
class GradientSNRResult:
    """Everything ``policygrad lab gradient-snr`` measured.

    Fields:
        estimators: :class:`EstimatorStats` in the order requested.
        reference: the reference gradient's own statistics (``rloo(k=S)`` over the reference draws).
        reward_mean, reward_std: of the (offset) rewards over the estimation draws.
        reward_offset: c; num_params: size of the measured gradient; params: the subset spec.
        critic_ev_fit, critic_ev_eval: explained variance of the linear critic (None without GAE).
        critic_ridge: the critic's ridge penalty (None without GAE).
        settings: the run's settings (prompts, S, draws, temperature, ...).
        table: printed text; json_path, png_path: files written (or None).
    """

    estimators: list[EstimatorStats]
    reference: EstimatorStats
    reward_mean: float
    reward_std: float
    reward_offset: float
    num_params: int
    params: str
    critic_ev_fit: float | None
    critic_ev_eval: float | None
    critic_ridge: float | None
    settings: dict[str, Any]
    table: str = ""
    json_path: str | None = None
    png_path: str | None = None

    def stats(self, name: str) -> EstimatorStats:
        """The statistics of estimator ``name`` (e.g. ``"rloo(k=4)"``).

        Raises:
            KeyError: unknown name (lists the measured ones).
        """
        for s in self.estimators:
            if s.name == name:
                return s
        raise KeyError(f"no estimator {name!r}; measured: {[s.name for s in self.estimators]}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        d = dataclasses.asdict(self)
        d.pop("table", None)
        return d


class _Accumulator:
    """Running sums of gradients, squared norms and cosines with a reference."""

    def __init__(self, dim: int):
        self.sum = torch.zeros(dim, dtype=torch.float64)
        self.sq = 0.0
        self.norms = 0.0
        self.cos = 0.0
        self.n = 0

    def add(self, g: torch.Tensor, ref: torch.Tensor | None) -> None:
        self.sum += g
        norm = float(g.norm())
        self.sq += norm * norm
        self.norms += norm
        if ref is not None:
            denom = norm * float(ref.norm())
            self.cos += float(g @ ref) / denom if denom > 0 else 0.0
        self.n += 1

    def stats(self, name: str, batch: int, ref: torch.Tensor | None) -> EstimatorStats:
        m = self.sum / self.n
        m2 = float(m @ m)
        noise = (self.sq - self.n * m2) / (self.n - 1)
        noise = max(noise, 0.0)
        signal = max(m2 - noise / self.n, 0.0)
        snr = signal / noise if noise > 0 else math.inf
        snr_raw = m2 / noise if noise > 0 else math.inf
        cos_mean = 1.0
        if ref is not None:
            denom = math.sqrt(m2) * float(ref.norm())
            cos_mean = float(m @ ref) / denom if denom > 0 else 0.0
        return EstimatorStats(
            name=name,
            draws=self.n,
            samples_per_batch=batch,
            snr=snr,
            snr_raw=snr_raw,
            cos_ref=self.cos / self.n if ref is not None else 1.0,
            cos_mean_ref=cos_mean,
            grad_norm=self.norms / self.n,
            noise=noise,
        )


# ---------------------------------------------------------------------------------------------- experiment


def _check_settings(estimators, samples_per_prompt, draws, reference_draws, critic_draws, max_new_tokens):
    """Validate the counts and estimators of :func:`run_gradient_snr` (before any model work).

    Returns:
        ``(specs, S, draws, reference_draws, critic_draws)``.

    Raises:
        ValueError / TypeError: see :func:`run_gradient_snr`.
    """
    specs = parse_estimators(estimators)
    S = check_positive_int(samples_per_prompt, "samples_per_prompt", minimum=2)
    draws = check_positive_int(draws, "draws", minimum=2)
    reference_draws = check_positive_int(reference_draws, "reference_draws", minimum=2)
    check_positive_int(max_new_tokens, "max_new_tokens")
    for spec in specs:
        if spec.kind == "rloo" and S % spec.k:
            raise ValueError(
                f"{spec.name}: samples_per_prompt={S} is not a multiple of k={spec.k}; use a multiple "
                "of every RLOO k (e.g. 8 for k = 2, 4, 8)"
            )
    if any(s.kind == "gae" for s in specs):
        critic_draws = check_positive_int(critic_draws, "critic_draws")
    return specs, S, draws, reference_draws, critic_draws


def _check_fields(
    fields: dict[str, Sequence[Any]] | None, prompts: Sequence[str]
) -> dict[str, Sequence[Any]]:
    """A copy of the per-prompt dataset fields, each with one value per prompt."""
    fields = dict(fields or {})
    for key, values in fields.items():
        if len(values) != len(prompts):
            raise ValueError(f"fields[{key!r}] has {len(values)} values for {len(prompts)} prompts")
    return fields


def _fit_critic(model, draw: Callable, seeds: Sequence[int], temperature: float):
    """The linear critic, fit on the final hidden states and Monte Carlo returns of one draw per
    seed (separate from the estimation draws), and its explained variance on them.

    Returns:
        ``(critic, ev_fit)``.
    """
    feats, targets, groups, fit_batches = [], [], [], []
    for j, draw_seed in enumerate(seeds):
        rollout, scores_t, _ = draw(draw_seed)
        hook = _HeadInput(model)
        try:
            with torch.no_grad():
                _whole_row_logprobs(model, rollout, temperature)
        finally:
            hook.remove()
        m = rollout.response_mask > 0
        hidden = hook.value.detach()
        feats.append(hidden[m])
        targets.append(scores_t[:, None].expand_as(rollout.response_mask)[m])
        B = rollout.response_mask.shape[0]
        rows = torch.arange(B)[:, None].expand_as(rollout.response_mask)
        groups.append((rows + j * B)[m])
        fit_batches.append((hidden, scores_t, rollout.response_mask))
    critic = LinearCritic().fit(torch.cat(feats), torch.cat(targets), torch.cat(groups))
    return critic, _ev(critic, fit_batches)


def _only_trainable(model, tensors) -> None:
    """``requires_grad`` on ``tensors`` alone."""
    for p in model.parameters():
        p.requires_grad_(False)
    for p in tensors:
        p.requires_grad_(True)


def _restore_flags(model, saved_flags, was_training: bool) -> None:
    """Put back the ``requires_grad`` flags and the train/eval mode that the model came with."""
    for p, flag in saved_flags:
        p.requires_grad_(flag)
    model.train(was_training)


def _add_estimator_gradients(
    accs, g_ref, model, rollout, token_rewards, specs, tensors, S: int, temperature: float, critic
):
    """Add one draw's gradient of every estimator to its accumulator; returns the critic's values
    on the draw (None without a critic)."""
    grads, values = estimator_gradients(
        model,
        rollout,
        token_rewards,
        specs,
        tensors,
        samples_per_prompt=S,
        temperature=temperature,
        critic=critic,
    )
    for acc, g in zip(accs, grads):
        acc.add(g, g_ref)
    return values


def run_gradient_snr(
    model,
    tokenizer,
    prompts: Sequence[str],
    reward_fn: RewardFn,
    *,
    fields: dict[str, Sequence[Any]] | None = None,
    estimators: str | Sequence[str] = DEFAULT_ESTIMATORS,
    samples_per_prompt: int = 8,
    draws: int = 8,
    reference_draws: int = 8,
    critic_draws: int = 2,
    temperature: float = 1.0,
    max_new_tokens: int = 16,
    reward_offset: float = 0.0,
    params: str = "last-layer",
    seed: int = 0,
    output_dir: str | None = DEFAULT_OUTPUT_DIR,
    progress: bool = False,
) -> GradientSNRResult:
    """Compare advantage estimators by gradient SNR and cosine to a reference (module docstring).

    Args:
        model: a causal LM (held fixed; its ``requires_grad`` flags are restored afterwards).
        tokenizer: its tokenizer (with a chat template, prompts are formatted with it).
        prompts: the user prompts of one batch (each sampled ``samples_per_prompt`` times per draw).
        reward_fn: ``reward_fn(prompts, completions, **fields) -> list[float]``, the signature of
            the reward registry (one row per sample; prompts and fields repeated per sample).
        fields: per-prompt dataset fields passed to ``reward_fn`` (e.g. ``{"answer": [...]}``).
        estimators: comma-separated specs (:func:`parse_estimators`).
        samples_per_prompt: S; a multiple of every RLOO k.
        draws: M independent batches per estimator (>= 2).
        reference_draws: batches averaged into the reference gradient (>= 2).
        critic_draws: batches the linear critic is fit on (GAE only).
        temperature, max_new_tokens: sampling.
        reward_offset: constant c added to every reward.
        params: the parameter subset (:func:`select_parameters`).
        seed: seeds every draw (estimation, reference and critic draws use disjoint seeds).
        output_dir: folder for ``gradient_snr.json`` / ``.png``; None writes nothing.
        progress: show a progress bar over the draws (stderr).

    Returns:
        :class:`GradientSNRResult`.

    Raises:
        ValueError: bad counts, estimators, parameter subset; S not a multiple of an RLOO k;
            a reward function returning the wrong number of scores.
    """
    specs, S, draws, reference_draws, critic_draws = _check_settings(
        estimators, samples_per_prompt, draws, reference_draws, critic_draws, max_new_tokens
    )
    use_critic = any(s.kind == "gae" for s in specs)
    if not math.isfinite(reward_offset):
        raise ValueError(f"reward_offset must be finite, got {reward_offset}")
    fields = _check_fields(fields, prompts)

    prompt_ids = tokenize_user_prompts(tokenizer, prompts)
    engine = HFRolloutEngine(model, tokenizer)
    rows_prompts = repeat_each(list(prompts), S)
    rows_fields = {k: repeat_each(list(v), S) for k, v in fields.items()}
    chosen = select_parameters(model, params)
    tensors = [p for _, p in chosen]
    num_params = sum(p.numel() for p in tensors)
    saved_flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    model.eval()
    B = len(prompts) * S

    from tqdm import tqdm

    total = (critic_draws if use_critic else 0) + reference_draws + draws
    bar = tqdm(total=total, desc="gradient-snr draws", disable=not progress, file=sys.stderr)

    def draw(draw_seed: int):
        bar.update(1)
        rollout = engine.generate(
            prompt_ids,
            group_size=S,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            generator_seed=draw_seed,
        )
        completions = decode_completions(tokenizer, rollout)
        scores = list(reward_fn(rows_prompts, completions, **rows_fields))
        if len(scores) != B:
            raise ValueError(f"reward_fn returned {len(scores)} scores for {B} completions")
        scores_t = torch.tensor([float(s) for s in scores], dtype=torch.float32) + reward_offset
        mask = rollout.response_mask
        token_rewards = last_token_rewards(scores_t, mask)
        return rollout, scores_t, token_rewards

    try:
        _only_trainable(model, tensors)
        base = seed * 1_000_003

        critic = None
        ev_fit = ev_eval = None
        if use_critic:
            critic, ev_fit = _fit_critic(
                model, draw, range(base + 200_000, base + 200_000 + critic_draws), temperature
            )

        # The reference gradient: rloo over all S samples of a prompt, many draws.
        ref_spec = EstimatorSpec(f"reference rloo(k={S})", "rloo", k=S)
        ref_acc = _Accumulator(num_params)
        for j in range(reference_draws):
            rollout, _, token_rewards = draw(base + 100_000 + j)
            (g,), _ = estimator_gradients(
                model,
                rollout,
                token_rewards,
                [ref_spec],
                tensors,
                samples_per_prompt=S,
                temperature=temperature,
            )
            ref_acc.add(g, None)
        g_ref = ref_acc.sum / ref_acc.n
        reference = ref_acc.stats(ref_spec.name, B, None)

        accs = [_Accumulator(num_params) for _ in specs]
        all_scores, eval_batches = [], []
        for j in range(draws):
            rollout, scores_t, token_rewards = draw(base + j)
            all_scores.append(scores_t)
            values = _add_estimator_gradients(
                accs, g_ref, model, rollout, token_rewards, specs, tensors, S, temperature, critic
            )
            if values is not None:
                eval_batches.append((values, scores_t, rollout.response_mask))
        if critic is not None:
            ev_eval = _ev(None, eval_batches)
    finally:
        bar.close()
        _restore_flags(model, saved_flags, was_training)

    rewards = torch.cat(all_scores)
    result = GradientSNRResult(
        estimators=[acc.stats(spec.name, B, g_ref) for acc, spec in zip(accs, specs)],
        reference=reference,
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std()),
        reward_offset=float(reward_offset),
        num_params=num_params,
        params=params,
        critic_ev_fit=ev_fit,
        critic_ev_eval=ev_eval,
        critic_ridge=critic.chosen_ridge if critic is not None else None,
        settings={
            "prompts": len(prompts),
            "samples_per_prompt": S,
            "draws": draws,
            "reference_draws": reference_draws,
            "critic_draws": critic_draws if use_critic else 0,
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "seed": seed,
            "aggregation": "seq-mean-token-sum",
            "loss": "vanilla",
        },
    )
    result.table = snr_table(result)
    if output_dir is not None:
        out = ensure_output_dir(output_dir)
        result.json_path = write_json(os.path.join(out, "gradient_snr.json"), result.to_dict())
        result.png_path = plot_snr(result, os.path.join(out, "gradient_snr.png"))
    return result


def _ev(critic: LinearCritic | None, batches) -> float:
    """Explained variance of the critic's values against the Monte Carlo returns, pooled."""
    values, returns, masks = [], [], []
    for first, scores, mask in batches:
        v = critic.predict(first) if critic is not None else first
        values.append(v.reshape(-1))
        returns.append(scores[:, None].expand_as(mask).reshape(-1))
        masks.append(mask.reshape(-1))
    ev = explained_variance(torch.cat(values)[None], torch.cat(returns)[None], torch.cat(masks)[None])
    return float(ev)


def snr_table(result: GradientSNRResult) -> str:
    """The estimator table as text, with the reference and critic lines."""
    s = result.settings
    head = (
        f"gradient SNR over {s['draws']} draws of B = {s['prompts']} prompts x "
        f"{s['samples_per_prompt']} samples; "
        f"gradient of {result.num_params:,} parameters ({result.params}); rewards mean "
        f"{result.reward_mean:.3f} std {result.reward_std:.3f} (offset {result.reward_offset:g})"
    )
    rows = [[e.name, e.snr, e.snr_raw, e.cos_ref, e.cos_mean_ref, e.grad_norm] for e in result.estimators]
    table = format_table(["estimator", "SNR", "SNR (raw)", "cos(g, ref)", "cos(mean, ref)", "|g|"], rows)
    lines = [
        head,
        table,
        "",
        f"reference: mean of {result.reference.name} over {result.reference.draws} draws; "
        f"single-draw SNR {result.reference.snr:.3g}",
    ]
    if result.critic_ev_fit is not None:
        lines.append(
            f"critic (linear head on final hidden states): explained variance {result.critic_ev_fit:.3f} "
            f"on its fit draws, {result.critic_ev_eval:.3f} on the estimation draws "
            f"(ridge {result.critic_ridge:g})"
        )
    return "\n".join(lines)


def plot_snr(result: GradientSNRResult, path: str) -> str:
    """Bars: SNR (log scale) and cosine to the reference, per estimator."""
    plt = pyplot()
    names = [e.name for e in result.estimators]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.9))
    colors = [
        "#7f7f7f"
        if n == "no-baseline"
        else "#1f77b4"
        if n.startswith("rloo")
        else "#2ca02c"
        if n == "grpo"
        else "#d62728"
        for n in names
    ]
    snr = [e.snr if math.isfinite(e.snr) else 0.0 for e in result.estimators]
    positive = [v for v in snr if v > 0]
    if positive and max(positive) / min(positive) > 20:
        # Orders of magnitude apart (a reward offset): a log axis, values floored for display.
        floor = min(positive) / 3
        axes[0].bar(names, [max(v, floor) for v in snr], color=colors)
        axes[0].set_yscale("log")
    else:
        axes[0].bar(names, snr, color=colors)
    axes[0].set_ylabel("||E g||^2 / E||g - E g||^2")
    axes[0].set_title(
        f"Gradient SNR (B = {result.estimators[0].samples_per_batch}, offset {result.reward_offset:g})"
    )
    axes[1].bar(names, [e.cos_ref for e in result.estimators], color=colors, label="one batch")
    axes[1].scatter(
        names, [e.cos_mean_ref for e in result.estimators], color="black", zorder=3, label="mean over draws"
    )
    axes[1].set_ylim(min(0.0, min(e.cos_ref for e in result.estimators)) - 0.05, 1.05)
    axes[1].axhline(0, color="black", lw=0.5)
    axes[1].set_ylabel("cosine to the reference gradient")
    axes[1].set_title("Direction")
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.tick_params(axis="x", rotation=35, labelsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="policygrad lab gradient-snr",
        description="Gradient signal-to-noise ratio and cosine to a reference gradient of advantage "
        "estimators (no baseline, RLOO, GRPO, GAE with a linear critic) at a fixed checkpoint.",
    )
    p.add_argument("--model", default="bundled:smollm2-135m-instruct")
    p.add_argument(
        "--dataset", default="builtin:arithmetic", help="builtin:arithmetic or a JSONL with answers"
    )
    p.add_argument("--difficulty", default="medium")
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch")
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--draws", type=int, default=8, help="independent batches per estimator")
    p.add_argument("--reference-draws", type=int, default=8, help="batches in the reference gradient")
    p.add_argument("--critic-draws", type=int, default=2, help="batches the GAE critic is fit on")
    p.add_argument("--estimators", default=DEFAULT_ESTIMATORS)
    p.add_argument("--params", default="last-layer", help="last-layer, lm-head, all, or a regex on names")
    p.add_argument("--reward-offset", type=float, default=0.0, help="constant c added to every reward")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    add_run_args(p)
    return p


def main(argv: list[str]) -> str:
    """``policygrad lab gradient-snr ...`` on a dataset with answers, scored by answer_correctness."""
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    check_positive_int(args.prompts, "--prompts")
    check_temperature(args.temperature)
    parameter_pattern(args.params)
    if not math.isfinite(args.reward_offset):
        raise ValueError(f"--reward-offset must be finite, got {args.reward_offset}")
    _check_settings(
        args.estimators,
        args.samples_per_prompt,
        args.draws,
        args.reference_draws,
        args.critic_draws,
        args.max_new_tokens,
    )
    output_dir = check_output_dir(args.output_dir)  # a file there is refused before any model work
    source = resolve_dataset(args.dataset, difficulty=args.difficulty, seed=args.seed, split="train")
    rows = [source.train_row(i) for i in range(args.prompts)]
    model, tokenizer = load_lab_model(args.model)
    result = run_gradient_snr(
        model,
        tokenizer,
        [r["prompt"] for r in rows],
        answer_correctness,
        fields={"answer": [r["answer"] for r in rows]},
        estimators=args.estimators,
        samples_per_prompt=args.samples_per_prompt,
        draws=args.draws,
        reference_draws=args.reference_draws,
        critic_draws=args.critic_draws,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        reward_offset=args.reward_offset,
        params=args.params,
        seed=args.seed,
        output_dir=output_dir,
        progress=True,
    )
    lines = [result.table]
    lines.append(f"\nwrote {result.json_path}\nwrote {result.png_path}")
    return "\n".join(lines)
