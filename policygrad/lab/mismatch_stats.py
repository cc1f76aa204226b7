"""The numbers of ``policygrad lab mismatch`` (the protocol: :mod:`policygrad.lab.mismatch`): the
per-token and per-sequence mismatch between two ways of computing the same log-probs
(:func:`pair_stats`), the result of a run, and its tables."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from policygrad.core.importance import truncated_importance_weights
from policygrad.lab.common import (
    format_table,
)


@dataclasses.dataclass
class PairStats:
    """Mismatch between two ways of computing the same log-probs.

    Fields:
        name: the pair; behaviour: the path treated as the sampler in the importance weight;
            target: the training path.
        n_tokens, n_sequences: measured.
        mean, std (sigma), abs_mean, abs_max, abs_p50, abs_p99: of ``delta`` per token (nats).
        token_trunc_frac: share of tokens with ``exp(delta) > cap``.
        token_weight_std, token_weight_std_truncated: spread of the token weights.
        seq_trunc_frac: share of sequences with ``exp(S_T) > cap`` (whole sequence).
        seq_weight_std, seq_weight_std_truncated: spread of the whole-sequence weights.
        seq_weight_max: largest untruncated sequence weight.
        lengths: t = 1..T_max; cum_std: std over sequences of S_t (sequences with >= t tokens);
            sigma_sqrt_t: ``sigma * sqrt(t)``; seq_weight_std_t / seq_weight_std_t_truncated:
            std of ``W_t`` without / with truncation; n_at_t: sequences with >= t tokens.
    """

    name: str
    behaviour: str
    target: str
    n_tokens: int
    n_sequences: int
    mean: float
    std: float
    abs_mean: float
    abs_max: float
    abs_p50: float
    abs_p99: float
    token_trunc_frac: float
    token_weight_std: float
    token_weight_std_truncated: float
    seq_trunc_frac: float
    seq_weight_std: float
    seq_weight_std_truncated: float
    seq_weight_max: float
    lengths: list[int]
    cum_std: list[float]
    sigma_sqrt_t: list[float]
    seq_weight_std_t: list[float]
    seq_weight_std_t_truncated: list[float]
    n_at_t: list[int]


def _std(x: torch.Tensor) -> float:
    return float(x.double().std()) if x.numel() > 1 else 0.0


def pair_stats(
    name: str,
    behaviour_name: str,
    target_name: str,
    behaviour_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float = 2.0,
) -> tuple[PairStats, torch.Tensor]:
    """Statistics of ``delta = logprobs - behaviour_logprobs`` on valid tokens.

    Args:
        behaviour_logprobs: [B, T] the path that "sampled" (the importance weight's denominator).
        logprobs: [B, T] the training path.
        response_mask: [B, T], nonzero = valid.
        cap: truncation of the importance weights (> 0).

    Returns:
        ``(PairStats, delta_valid)`` with ``delta_valid`` the 1-D float64 tensor of valid deltas.

    Raises:
        ValueError: no valid token; shapes differ; a bad ``cap`` (from the core function).
    """
    mask = response_mask != 0
    if not bool(mask.any()):
        raise ValueError("response_mask has no valid token: nothing to measure")
    lp = logprobs.double()
    bp = behaviour_logprobs.double()
    delta = torch.where(mask, lp - bp, torch.zeros((), dtype=torch.float64))
    valid = delta[mask]
    sigma = _std(valid)
    absd = valid.abs()
    log_cap = math.log(cap)
    token_w = truncated_importance_weights(bp, lp, mask, level="token", cap=cap)[mask]
    raw_token_w = valid.exp()
    lengths = mask.sum(-1)
    seq_log = delta.sum(-1)
    has = lengths > 0
    seq_w_trunc = truncated_importance_weights(bp, lp, mask, level="sequence", cap=cap)
    first = torch.where(mask, seq_w_trunc, torch.zeros_like(seq_w_trunc)).max(-1).values[has]

    T = int(lengths.max())
    cum = delta.cumsum(-1)
    ts, cum_std, sqrt_t, w_std, w_std_trunc, n_at = [], [], [], [], [], []
    for t in range(1, T + 1):
        rows = lengths >= t
        n = int(rows.sum())
        if n < 2:
            break
        s_t = cum[rows, t - 1]
        prefix = mask.clone()
        prefix[:, t:] = False
        w_t = truncated_importance_weights(bp, lp, prefix, level="sequence", cap=cap)[rows, 0]
        ts.append(t)
        cum_std.append(_std(s_t))
        sqrt_t.append(sigma * math.sqrt(t))
        w_std.append(_std(s_t.exp()))
        w_std_trunc.append(_std(w_t))
        n_at.append(n)
    stats = PairStats(
        name=name,
        behaviour=behaviour_name,
        target=target_name,
        n_tokens=int(valid.numel()),
        n_sequences=int(has.sum()),
        mean=float(valid.mean()),
        std=sigma,
        abs_mean=float(absd.mean()),
        abs_max=float(absd.max()),
        abs_p50=float(absd.quantile(0.5)),
        abs_p99=float(absd.quantile(0.99)),
        token_trunc_frac=float((valid > log_cap).double().mean()),
        token_weight_std=_std(raw_token_w),
        token_weight_std_truncated=_std(token_w),
        seq_trunc_frac=float((seq_log[has] > log_cap).double().mean()),
        seq_weight_std=_std(seq_log[has].exp()),
        seq_weight_std_truncated=_std(first),
        seq_weight_max=float(seq_log[has].exp().max()),
        lengths=ts,
        cum_std=cum_std,
        sigma_sqrt_t=sqrt_t,
        seq_weight_std_t=w_std,
        seq_weight_std_t_truncated=w_std_trunc,
        n_at_t=n_at,
    )
    return stats, valid


@dataclasses.dataclass
class MismatchResult:
    """Everything ``policygrad lab mismatch`` measured.

    Fields:
        pairs: :class:`PairStats` per compared pair, keyed by name (``sampler vs recompute``,
            ``bf16 vs fp32``, and per measured precision P ``P: sampler vs trainer`` and
            ``P: trainer vs fp32``).
        precisions: the measured precisions, in order; skipped: ``{precision: why}`` for those
            the device cannot run.
        deltas: per pair, the valid per-token deltas (for the histogram; not in the JSON).
        cap: the truncation cap; settings: run settings.
        table: printed text; json_path, png_path: files written (or None).
    """

    pairs: dict[str, PairStats]
    deltas: dict[str, list[float]]
    cap: float
    settings: dict[str, Any]
    precisions: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    table: str = ""
    json_path: str | None = None
    png_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (without the raw deltas); with measured precisions, also
        ``precisions`` (``{P: {"sampler_vs_trainer": pair, "trainer_vs_fp32": pair}}``) and
        ``skipped`` (``{P: why}``)."""
        out = {
            "cap": self.cap,
            "settings": self.settings,
            "pairs": {k: dataclasses.asdict(v) for k, v in self.pairs.items()},
        }
        if self.precisions or self.skipped:
            out["precisions"] = {
                p: {
                    "sampler_vs_trainer": dataclasses.asdict(self.pairs[f"{p}: sampler vs trainer"]),
                    "trainer_vs_fp32": dataclasses.asdict(self.pairs[f"{p}: trainer vs fp32"]),
                }
                for p in self.precisions
            }
            out["skipped"] = dict(self.skipped)
        return out


def precision_table(result: MismatchResult) -> str:
    """One row per measured precision: the sampler/trainer gap in it, and its distance from
    float32; then a line per skipped precision saying why."""
    rows = []
    for p in result.precisions:
        st, tf = result.pairs[f"{p}: sampler vs trainer"], result.pairs[f"{p}: trainer vs fp32"]
        rows.append(
            [p, st.n_tokens, st.abs_mean, st.abs_p99, st.abs_max, st.seq_weight_std, tf.abs_mean, tf.abs_max]
        )
    lines = ["sampler/trainer gap per training precision (each samples and recomputes in that precision)"]
    if rows:
        lines.append(
            format_table(
                [
                    "precision",
                    "tokens",
                    "mean |d|",
                    "p99 |d|",
                    "max |d|",
                    "seq W std",
                    "vs fp32 mean |d|",
                    "vs fp32 max |d|",
                ],
                rows,
            )
        )
    lines += [f"skipped {p}: {why}" for p, why in result.skipped.items()]
    return "\n".join(lines)


def mismatch_table(result: MismatchResult) -> str:
    """Per-pair tables: the delta distribution, the importance weights, and S_t against length."""
    pairs = list(result.pairs.values())
    s = result.settings
    head = (
        f"per-token log-ratio delta = log pi_train(fp32 full forward) - log pi_other at the sampled tokens; "
        f"{pairs[0].n_sequences} sequences, {pairs[0].n_tokens} tokens (mean length {s['mean_length']:.1f})"
    )
    if result.precisions:
        head += "; a 'P: a vs b' pair is log pi_b - log pi_a, both computed in precision P except fp32"
    dist = format_table(
        ["pair", "mean", "sigma", "mean |d|", "p50 |d|", "p99 |d|", "max |d|"],
        [[p.name, p.mean, p.std, p.abs_mean, p.abs_p50, p.abs_p99, p.abs_max] for p in pairs],
    )
    cap = result.cap
    weights = format_table(
        [
            "pair",
            "tok trunc frac",
            "tok w std",
            f"(cap {cap:g})",
            "seq trunc frac",
            "seq W std",
            f"(cap {cap:g})",
            "seq W max",
        ],
        [
            [
                p.name,
                p.token_trunc_frac,
                p.token_weight_std,
                p.token_weight_std_truncated,
                p.seq_trunc_frac,
                p.seq_weight_std,
                p.seq_weight_std_truncated,
                p.seq_weight_max,
            ]
            for p in pairs
        ],
    )
    lines = [head, dist, "", f"importance weights pi_train / pi_other (truncated at {cap:g})", weights, ""]
    for p in pairs:
        if not p.lengths:
            continue
        picks = sorted({i for i in (0, len(p.lengths) // 4, len(p.lengths) // 2, len(p.lengths) - 1)})
        lines.append(f"{p.name}: spread of S_t = sum of the first t deltas")
        lines.append(
            format_table(
                ["t", "sequences", "std S_t", "sigma sqrt(t)", "std W_t", f"std min(W_t, {cap:g})"],
                [
                    [
                        p.lengths[i],
                        p.n_at_t[i],
                        p.cum_std[i],
                        p.sigma_sqrt_t[i],
                        p.seq_weight_std_t[i],
                        p.seq_weight_std_t_truncated[i],
                    ]
                    for i in picks
                ],
            )
        )
        lines.append("")
    if result.precisions or result.skipped:
        lines.append(precision_table(result))
    return "\n".join(lines).rstrip()
