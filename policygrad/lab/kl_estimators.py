"""How good are the KL estimators k1, k2, k3, and which KL does each placement optimise
(``policygrad lab kl-estimators``).

Three experiments, all on :func:`policygrad.core.kl.kl_estimate` and the core's KL terms:

1. Gaussian pairs (Schulman 2020, "Approximating KL Divergence", which defines k1/k2/k3 and
   tabulates their bias and spread on this Gaussian example): samples ``x ~ q = N(0, 1)``,
   ``p = N(mu, 1)``, true ``KL(q || p) = mu^2 / 2``. With ``log(q/p) = mu^2/2 - mu x`` each
   estimator's bias and standard deviation are reported relative to the true KL, next to their
   closed forms:

   - k1: bias 0, ``std / KL = 2 / mu`` (20 at mu = 0.1);
   - k2: ``bias / KL = mu^2 / 4``, ``std / KL = sqrt(mu^4/2 + mu^6/4) / (mu^2/2)``;
   - k3: bias 0, ``std / KL = sqrt(exp(mu^2) - 1 - mu^2) / (mu^2/2)`` (1.417 at mu = 0.1),
     from ``E_q[r] = 1``, ``E_q[r^2] = exp(mu^2)``, ``E_q[r log r] = mu^2/2`` with ``r = p/q``.

2. Real token distributions: a model pi and a perturbed copy pi_ref (every weight tensor W gets
   ``W + s * rms(W) * N(0, 1)`` noise). Tokens are sampled from pi; at every response position the
   exact ``KL(pi || pi_ref)`` of the full softmax is compared with k1/k2/k3 at the sampled token.

3. Placements, by exact enumeration over a small categorical (Tang & Munos 2025, "On a Few
   Pitfalls in KL Divergence Gradient Estimation for RL"; Shah et al. 2025; Zhang et al. 2025;
   ``w * k3`` as in DeepSeek-V3.2, 2025; k1 in the reward as in Ziegler et al. 2019, k3 in the
   loss as in GRPO, Shao et al. 2024, section 4.1.2): the expected gradient of each placement
   (k1/k2/k3 in the reward, through the score function; k1/k2/k3 and ``w * k3`` in the loss,
   differentiated at the sampled token) is compared with the autograd gradients of
   ``KL(pi || ref)`` (reverse) and ``KL(ref || pi)`` (forward). Theory: k1 in the reward ->
   reverse; k2 in the loss -> reverse; k3 in the loss -> forward; ``w * k3`` in the loss ->
   reverse; k1 in the loss -> zero; k2 and k3 in the reward -> neither.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from policygrad.arguments import OneLineArgumentParser
from policygrad.core.kl import KL_KINDS, kl_estimate
from policygrad.core.logprobs import logprobs_from_logits
from policygrad.lab.common import (
    DEFAULT_OUTPUT_DIR,
    add_run_args,
    check_output_dir,
    check_positive_int,
    ensure_output_dir,
    format_table,
    load_lab_model,
    parse_float_list,
    pyplot,
    save_figure,
    set_threads,
    tokenize_user_prompts,
    write_json,
)
from policygrad.lab.kl_exact import (
    DEFAULT_MUS,
    GaussianRow,
    PlacementRow,
    gaussian_kl_table,
    placement_table,
)
from policygrad.models.forward import response_logits
from policygrad.rollout.hf import HFRolloutEngine

DEFAULT_PROMPTS = (
    "What is 12 + 7? Answer with just the number.",
    "Name three colours.",
    "Write one sentence about the sea.",
    "What is the capital of France?",
)


# ---------------------------------------------------------------------------------------------- 2. tokens


@dataclasses.dataclass
class TokenRow:
    """k1/k2/k3 at sampled tokens against the exact per-position KL, for one noise scale.

    Fields:
        noise_scale: s, noise relative to each weight tensor's RMS.
        kind: k1/k2/k3; n_tokens: response positions measured.
        exact_kl_mean: mean over positions of the exact ``KL(pi || pi_ref)`` (nats per token).
        estimate_mean: mean of the estimator at the sampled tokens.
        bias_rel: ``(estimate_mean - exact_kl_mean) / exact_kl_mean``.
        std_rel: ``std(estimate) / exact_kl_mean`` over positions.
        frac_negative: share of positions with a negative estimate.
    """

    noise_scale: float
    kind: str
    n_tokens: int
    exact_kl_mean: float
    estimate_mean: float
    bias_rel: float
    std_rel: float
    frac_negative: float


def perturbed_copy(model: torch.nn.Module, scale: float, *, seed: int = 0) -> torch.nn.Module:
    """A deep copy of ``model`` with ``W + scale * rms(W) * N(0, 1)`` added to every parameter
    tensor (tied tensors once), drawn from a generator seeded with ``seed``.

    Raises:
        ValueError: ``scale`` < 0 or not finite.
    """
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"noise scale must be a finite number >= 0, got {scale}")
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            rms = p.detach().float().square().mean().sqrt()
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.add_((scale * rms * noise).to(p.dtype))
    return other


def token_kl_measurements(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    noise_scales: Sequence[float] = (0.02, 0.05),
    samples_per_prompt: int = 4,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
) -> tuple[list[TokenRow], dict[float, dict[str, list[float]]]]:
    """Exact per-position KL(pi || pi_ref) against k1/k2/k3 at tokens sampled from pi.

    Responses are sampled with :class:`~policygrad.rollout.hf.HFRolloutEngine` from ``model``;
    both models' logits at the response positions come from
    :func:`policygrad.models.forward.response_logits`; the estimators use
    :func:`~policygrad.core.logprobs.logprobs_from_logits` at ``temperature`` and
    :func:`~policygrad.core.kl.kl_estimate`; the exact KL is the float64 sum over the vocabulary
    of ``softmax(z/T) * (log_softmax(z/T) - log_softmax(z_ref/T))``.

    Returns:
        ``(rows, per_token)``: the :class:`TokenRow` table, and for each noise scale the lists
        ``exact``, ``k1``, ``k2``, ``k3`` of per-position values (for plots).

    Raises:
        ValueError: bad prompts, counts or noise scales.
    """
    check_positive_int(samples_per_prompt, "samples_per_prompt")
    check_positive_int(max_new_tokens, "max_new_tokens")
    if not noise_scales:
        raise ValueError("noise_scales is empty; give at least one scale such as 0.05")
    prompt_ids = tokenize_user_prompts(tokenizer, prompts)
    engine = HFRolloutEngine(model, tokenizer)
    rollout = engine.generate(
        prompt_ids,
        group_size=samples_per_prompt,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        generator_seed=seed,
    )
    mask = rollout.response_mask > 0
    with torch.no_grad():
        logits = response_logits(model, rollout).double() / temperature
        logp_all = torch.log_softmax(logits, -1)
        logprobs = logprobs_from_logits(logits, rollout.response_ids)
    rows, per_token = [], {}
    for i, scale in enumerate(noise_scales):
        ref_model = perturbed_copy(model, float(scale), seed=seed + 1 + i)
        with torch.no_grad():
            ref_logits = response_logits(ref_model, rollout).double() / temperature
            ref_all = torch.log_softmax(ref_logits, -1)
            exact = (logp_all.exp() * (logp_all - ref_all)).sum(-1)[mask]
            ref_logprobs = logprobs_from_logits(ref_logits, rollout.response_ids)
        del ref_model, ref_logits, ref_all
        kl_mean = float(exact.mean())
        per_token[float(scale)] = {"exact": exact.tolist()}
        for kind in KL_KINDS:
            est = kl_estimate(logprobs, ref_logprobs, kind)[mask]
            per_token[float(scale)][kind] = est.tolist()
            rows.append(
                TokenRow(
                    noise_scale=float(scale),
                    kind=kind,
                    n_tokens=int(mask.sum()),
                    exact_kl_mean=kl_mean,
                    estimate_mean=float(est.mean()),
                    bias_rel=float((est.mean() - kl_mean) / kl_mean),
                    std_rel=float(est.std() / kl_mean),
                    frac_negative=float((est < 0).double().mean()),
                )
            )
    return rows, per_token


# ---------------------------------------------------------------------------------------------- result, plot


@dataclasses.dataclass
class KLEstimatorsResult:
    """Everything ``policygrad lab kl-estimators`` measured.

    Fields:
        gaussian: :class:`GaussianRow` per (mu, kind).
        placements: :class:`PlacementRow` per (setting, placement, estimator).
        tokens: :class:`TokenRow` per (noise scale, kind); empty when no model was given.
        token_values: per noise scale, the per-position exact KL and estimates (not in the table).
        model: the model spec used for the token experiment, or None.
        table: the printed text; json_path, png_path: files written (or None).
    """

    gaussian: list[GaussianRow]
    placements: list[PlacementRow]
    tokens: list[TokenRow]
    token_values: dict[float, dict[str, list[float]]]
    model: str | None = None
    table: str = ""
    json_path: str | None = None
    png_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the per-token values are left out: they are large)."""
        return {
            "model": self.model,
            "gaussian": [dataclasses.asdict(r) for r in self.gaussian],
            "placements": [dataclasses.asdict(r) for r in self.placements],
            "tokens": [dataclasses.asdict(r) for r in self.tokens],
        }


def kl_tables(result: KLEstimatorsResult) -> str:
    """The three tables as text."""
    parts = [
        "Gaussian pairs q = N(0,1), p = N(mu,1): estimator bias and std relative to the true KL "
        f"(N = {result.gaussian[0].n_samples:,}; theory in brackets)",
        format_table(
            ["mu", "KL", "kind", "bias/KL", "(theory)", "std/KL", "(theory)", "P(<0)"],
            [
                [
                    r.mu,
                    r.true_kl,
                    r.kind,
                    r.bias_rel,
                    r.theory_bias_rel,
                    r.std_rel,
                    r.theory_std_rel,
                    r.frac_negative,
                ]
                for r in result.gaussian
            ],
        ),
    ]
    if result.tokens:
        parts += [
            "",
            f"Token distributions: {result.model} vs a copy with weight noise s * rms(W); exact "
            "per-position KL(pi || pi_ref) against the estimate at the sampled token",
            format_table(
                ["noise s", "kind", "tokens", "exact KL/token", "estimate", "bias/KL", "std/KL", "P(<0)"],
                [
                    [
                        r.noise_scale,
                        r.kind,
                        r.n_tokens,
                        r.exact_kl_mean,
                        r.estimate_mean,
                        r.bias_rel,
                        r.std_rel,
                        r.frac_negative,
                    ]
                    for r in result.tokens
                ],
            ),
        ]
    parts += [
        "",
        "Which KL each placement's expected gradient follows (exact enumeration, V = 8; reverse = "
        "KL(pi||ref), forward = KL(ref||pi))",
        format_table(
            [
                "setting",
                "placement",
                "estimator",
                "theory",
                "measured",
                "cos(reverse)",
                "cos(forward)",
                "match",
            ],
            [
                [
                    r.setting,
                    r.placement,
                    r.estimator,
                    r.theory,
                    r.measured,
                    r.cos_reverse,
                    r.cos_forward,
                    "yes" if r.matches else "NO",
                ]
                for r in result.placements
            ],
        ),
    ]
    return "\n".join(parts)


def plot_kl(result: KLEstimatorsResult, path: str) -> str:
    """Panels: std/KL vs mu, bias/KL vs mu (Gaussians), and estimate vs exact KL at real tokens."""
    plt = pyplot()
    n_panels = 3 if result.tokens else 2
    fig, axes = plt.subplots(1, n_panels, figsize=(4.6 * n_panels, 3.8))
    colors = {"k1": "#d62728", "k2": "#2ca02c", "k3": "#1f77b4"}
    mus = sorted({r.mu for r in result.gaussian})
    for kind in KL_KINDS:
        rows = sorted((r for r in result.gaussian if r.kind == kind), key=lambda r: r.mu)
        axes[0].plot(mus, [r.std_rel for r in rows], "o-", color=colors[kind], label=kind)
        axes[0].plot(mus, [r.theory_std_rel for r in rows], ":", color=colors[kind])
        axes[1].plot(mus, [r.bias_rel for r in rows], "o-", color=colors[kind], label=kind)
        axes[1].plot(mus, [r.theory_bias_rel for r in rows], ":", color=colors[kind])
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="mu  (p = N(mu,1), q = N(0,1))",
        ylabel="std / true KL",
        title="Spread (dotted: closed form)",
    )
    axes[1].set(xscale="log", xlabel="mu", ylabel="bias / true KL", title="Bias (k2 grows as mu^2/4)")
    axes[0].legend()
    axes[1].axhline(0, color="black", lw=0.5)
    if result.tokens:
        ax = axes[2]
        scale = min(result.token_values)  # the closest pair: where k3's control variate helps
        vals = result.token_values[scale]
        exact = vals["exact"]
        for kind in KL_KINDS:
            ax.scatter(exact, vals[kind], s=5, alpha=0.45, color=colors[kind], label=kind)
        positive = [v for v in exact if v > 0] or [1e-12]
        lo, hi = min(positive), max(positive)
        ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="exact KL")
        ax.set(
            xscale="log",
            xlabel="exact KL(pi || pi_ref) at the position (nats)",
            ylabel="estimate at the sampled token",
            title=f"Real tokens, weight noise s = {scale:g}",
        )
        ax.set_yscale("symlog", linthresh=1e-3)
        ticks = [-10.0, -1.0, -0.1, -0.01, 0.0, 0.01, 0.1, 1.0, 10.0]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.axhline(0, color="black", lw=0.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def run_kl_estimators(
    *,
    mus: Sequence[float] = DEFAULT_MUS,
    n_samples: int = 1_000_000,
    model=None,
    tokenizer=None,
    model_name: str | None = None,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    noise_scales: Sequence[float] = (0.02, 0.05),
    samples_per_prompt: int = 4,
    max_new_tokens: int = 32,
    vocab_size: int = 8,
    seed: int = 0,
    output_dir: str | None = DEFAULT_OUTPUT_DIR,
) -> KLEstimatorsResult:
    """Run the three experiments; write ``kl_estimators.json`` / ``.png`` under ``output_dir``.

    Args:
        mus, n_samples: the Gaussian table (:func:`gaussian_kl_table`).
        model, tokenizer: a loaded causal LM and its tokenizer for the token experiment; None
            skips it.
        model_name: label of the model in the tables.
        prompts, noise_scales, samples_per_prompt, max_new_tokens: :func:`token_kl_measurements`.
        vocab_size: outcomes of the categorical of the placement table.
        seed: seeds every draw.
        output_dir: folder for the files; None writes nothing.

    Returns:
        :class:`KLEstimatorsResult` (``table`` filled).
    """
    gaussian = gaussian_kl_table(mus, n_samples=n_samples, seed=seed)
    placements = placement_table(vocab_size=vocab_size, seed=seed)
    tokens, values = [], {}
    if model is not None:
        if tokenizer is None:
            raise ValueError("tokenizer is required with model")
        tokens, values = token_kl_measurements(
            model,
            tokenizer,
            prompts,
            noise_scales=noise_scales,
            samples_per_prompt=samples_per_prompt,
            max_new_tokens=max_new_tokens,
            seed=seed,
        )
    result = KLEstimatorsResult(gaussian, placements, tokens, values, model=model_name)
    result.table = kl_tables(result)
    if output_dir is not None:
        out = ensure_output_dir(output_dir)
        result.json_path = write_json(os.path.join(out, "kl_estimators.json"), result.to_dict())
        result.png_path = plot_kl(result, os.path.join(out, "kl_estimators.png"))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="policygrad lab kl-estimators",
        description="Bias and spread of the KL estimators k1, k2, k3 (Gaussian pairs and real token "
        "distributions) and which KL each placement's gradient follows.",
    )
    p.add_argument("--mu", default=",".join(str(m) for m in DEFAULT_MUS), help="comma-separated means of p")
    p.add_argument("--samples", type=int, default=1_000_000, help="N Gaussian samples (default 1e6)")
    p.add_argument(
        "--model",
        default="bundled:smollm2-135m-instruct",
        help="model for the token experiment; 'none' skips it",
    )
    p.add_argument("--noise", default="0.02,0.05", help="weight-noise scales s (relative to rms(W))")
    p.add_argument("--prompts", type=int, default=len(DEFAULT_PROMPTS), help="how many built-in prompts")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    add_run_args(p)
    return p


def main(argv: list[str]) -> str:
    """``policygrad lab kl-estimators ...``."""
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    mus = parse_float_list(args.mu, "--mu")
    noise = parse_float_list(args.noise, "--noise")
    if any(n <= 0 for n in noise):
        raise ValueError(f"--noise scales must be > 0 (a copy with no noise has KL 0), got {args.noise}")
    if any(m == 0 for m in mus):
        raise ValueError("--mu must not contain 0: the true KL is 0 and relative bias/std are undefined")
    check_positive_int(args.samples, "--samples", minimum=2)
    check_positive_int(args.samples_per_prompt, "--samples-per-prompt")
    check_positive_int(args.max_new_tokens, "--max-new-tokens")
    if not 1 <= args.prompts <= len(DEFAULT_PROMPTS):
        raise ValueError(f"--prompts must be in 1..{len(DEFAULT_PROMPTS)}, got {args.prompts}")
    output_dir = check_output_dir(args.output_dir)  # a file there is refused before the model loads
    model = tokenizer = None
    name = None
    if args.model.lower() != "none":
        model, tokenizer = load_lab_model(args.model)
        name = args.model
    result = run_kl_estimators(
        mus=mus,
        n_samples=args.samples,
        model=model,
        tokenizer=tokenizer,
        model_name=name,
        prompts=DEFAULT_PROMPTS[: args.prompts],
        noise_scales=noise,
        samples_per_prompt=args.samples_per_prompt,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        output_dir=output_dir,
    )
    lines = [result.table]
    lines.append(f"\nwrote {result.json_path}\nwrote {result.png_path}")
    return "\n".join(lines)
