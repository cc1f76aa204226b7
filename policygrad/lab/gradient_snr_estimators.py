"""The candidates of ``policygrad lab gradient-snr`` (the protocol: :mod:`policygrad.lab.gradient_snr`):
the advantage estimators by name and their advantages on one batch, the parameters measured, the
linear critic GAE's values come from, and one REINFORCE gradient per estimator from one forward
pass (:func:`estimator_gradients`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch

from policygrad.core.advantages import estimate_advantages
from policygrad.core.losses import get_policy_loss
from policygrad.core.masking import aggregate
from policygrad.models.forward import policy_logprobs

# ---------------------------------------------------------------------------------------------- estimators

DEFAULT_ESTIMATORS = "none,rloo2,rloo4,rloo8,grpo,gae0,gae0.5,gae0.95,gae1"


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


class HeadInput:
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


def whole_row_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """[B, T] float32 log-probs at ``temperature`` from one plain forward over whole rows through
    the lm_head module (no prompt sharing, no fused head), so a :class:`HeadInput` hook sees the
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
    hook = HeadInput(model) if (critic is not None or shared_head_backward) else None
    try:
        with torch.enable_grad():
            # One forward over whole rows: the hook reads the lm_head input of every position.
            logprobs = whole_row_logprobs(model, rollout, temperature)
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
