"""The numbers of ``policygrad lab gradient-snr`` (the protocol and the statistics:
:mod:`policygrad.lab.gradient_snr`): one estimator's SNR and cosines over its draws, the result of
a run, and its table and plot."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from policygrad.lab.common import (
    format_table,
    pyplot,
    save_figure,
)

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


class Accumulator:
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
