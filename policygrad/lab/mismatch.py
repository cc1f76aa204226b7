"""How off-policy is an "on-policy" run? The train/inference mismatch meter
(``policygrad lab mismatch``).

The sampler and the trainer compute the probability of the same token with the same weights by
different arithmetic, so "on-policy" training is slightly off-policy (Yao et al. 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training", which proposes truncated
importance sampling; Qi et al. 2025, "Defeating the Training-Inference Mismatch via FP16", which
traces much of the gap to bf16 rounding). This command measures, at the sampled tokens, the
per-token log-ratio ``delta_t = log pi_train - log pi_other`` for two pairs:

- ``sampler vs recompute``: the generation path (:class:`~policygrad.rollout.hf.HFRolloutEngine`,
  incremental decoding with the KV cache, its ``sampler_logprobs``) against the training recompute
  (:func:`policygrad.models.forward.policy_logprobs`: one full forward, float32 weights);
- ``bf16 vs fp32``: the full forward of a bfloat16 copy of the model against the float32 one
  (the log-softmax itself is float32 in both, :func:`policygrad.core.logprobs_from_logits`).

For each pair it reports the distribution of ``delta`` (a histogram of ``log10 |delta|``), and
how the sequence-level log-ratio ``S_t = sum_{s<=t} delta_s`` spreads with length: the std over
sequences of ``S_t`` against ``sigma * sqrt(t)`` (sigma = per-token std; the std of a sum of t
independent per-token differences, i.e. a random walk), and the std of the sequence
importance weight ``W_t = exp(S_t)`` with and without truncation at ``cap``
(:func:`policygrad.core.importance.truncated_importance_weights`, ``level="sequence"`` on the first
t tokens), plus the token-level weights ``min(exp(delta_t), cap)``: fraction truncated and spread.

With ``--precisions`` (e.g. ``fp32,bf16-mixed,bf16-mixed+fp32-head,fp16-mixed``) it also measures
the gap per training precision (``model.precision``, ``+fp32-head`` adding
``model.lm_head_dtype: float32``), the way a run in that precision sees it: the hf engine samples
under the precision's autocast (float32 weights, bf16/fp16 compute, the float32 head where asked)
and the trainer recomputes under the same autocast, giving two pairs per precision:

- ``P: sampler vs trainer``: the sampler's log-probs against the trainer's recompute, both in P
  (what a run's ``mismatch/*`` metrics and its importance correction see);
- ``P: trainer vs fp32``: P's recompute against the float32 full forward of the same tokens (how
  far P's arithmetic is from exact).

A precision the device cannot run (fp16 without float16 autocast, bf16 on a GPU without it) is
skipped with a line saying why. Each precision samples its own tokens from the same seed.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from collections.abc import Sequence

import torch

from policygrad.arguments import OneLineArgumentParser, check_temperature
from policygrad.lab.common import (
    DEFAULT_OUTPUT_DIR,
    add_run_args,
    check_output_dir,
    check_positive_int,
    ensure_output_dir,
    load_lab_model,
    pyplot,
    save_figure,
    set_threads,
    tokenize_user_prompts,
    write_json,
)
from policygrad.lab.mismatch_stats import (
    MismatchResult,
    mismatch_table,
    pair_stats,
)
from policygrad.models.forward import policy_logprobs
from policygrad.parallel.precision import resolve_precision, unsupported_reason
from policygrad.rollout.hf import HFRolloutEngine

DEFAULT_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe your favourite city in detail.",
    "What is 23 + 19? Explain step by step.",
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

PRECISION_NAMES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure")
"""``model.precision`` values ``--precisions`` takes; ``NAME+fp32-head`` adds the float32 head to a
mixed one."""
HEAD_SUFFIX = "+fp32-head"


def parse_precisions(text: str | Sequence[str]) -> list[str]:
    """``--precisions``: comma-separated ``model.precision`` values (:data:`PRECISION_NAMES`), a
    mixed one optionally with ``+fp32-head``; duplicates dropped, order kept.

    Raises:
        ValueError: an unknown name, or ``+fp32-head`` on a precision without autocast (one line
            naming it and the valid forms)."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else [str(t) for t in text]
    out: list[str] = []
    for item in items:
        if not item:
            continue
        base = item.removesuffix(HEAD_SUFFIX)
        if base not in PRECISION_NAMES or (item != base and base not in ("bf16-mixed", "fp16-mixed")):
            raise ValueError(
                f"--precisions: {item!r} is not valid; use {', '.join(PRECISION_NAMES)}, or "
                f"bf16-mixed{HEAD_SUFFIX} / fp16-mixed{HEAD_SUFFIX} (the float32 head needs an autocast "
                "around it)"
            )
        if item not in out:
            out.append(item)
    return out


def run_mismatch(
    model,
    tokenizer,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    *,
    samples_per_prompt: int = 4,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    sampler_dtype: str = "float32",
    cap: float = 2.0,
    seed: int = 0,
    precisions: str | Sequence[str] = (),
    output_dir: str | None = DEFAULT_OUTPUT_DIR,
) -> MismatchResult:
    """Measure the sampler/recompute and bf16/fp32 mismatches, and per training precision
    (module docstring).

    Args:
        model: a float32 causal LM (not modified; a bfloat16 deep copy is made).
        tokenizer: its tokenizer.
        prompts: user prompts (chat template applied); open-ended ones give long responses.
        samples_per_prompt, max_new_tokens, temperature: sampling (full softmax, no top-k/top-p).
        sampler_dtype: ``float32`` (default) or ``bfloat16``: the weights the sampler decodes with.
        cap: importance-weight cap (> 0), 2 by default.
        seed: sampling seed.
        precisions: training precisions to measure (:func:`parse_precisions`: names or one
            comma-separated string); empty: none (the two pairs above only).
        output_dir: folder for ``mismatch.json`` / ``.png``; None writes nothing.

    Returns:
        :class:`MismatchResult`.

    Raises:
        ValueError: unknown ``sampler_dtype`` (lists the valid ones); a model not in float32;
            bad counts or ``cap``; an unknown precision.
    """
    precisions = parse_precisions(precisions)
    if sampler_dtype not in _DTYPES:
        raise ValueError(f"unknown sampler dtype {sampler_dtype!r}; valid: {', '.join(_DTYPES)}")
    check_positive_int(samples_per_prompt, "samples_per_prompt")
    check_positive_int(max_new_tokens, "max_new_tokens")
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        raise ValueError(f"the model must be loaded in float32 (the training path), got {dtype}")
    bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
    sampler = model if sampler_dtype == "float32" else bf16
    prompt_ids = tokenize_user_prompts(tokenizer, prompts)
    engine = HFRolloutEngine(sampler, tokenizer)
    rollout = engine.generate(
        prompt_ids,
        group_size=samples_per_prompt,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        generator_seed=seed,
    )
    mask = rollout.response_mask
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            lp32, _ = policy_logprobs(model, rollout, temperature=temperature, top_k=0, top_p=1.0)
            lp16, _ = policy_logprobs(bf16, rollout, temperature=temperature, top_k=0, top_p=1.0)
    finally:
        model.train(was_training)
    del bf16
    pairs, deltas = {}, {}
    sampler_label = f"sampler ({sampler_dtype}, KV cache)"
    for name, behaviour, other in (
        ("sampler vs recompute", sampler_label, rollout.sampler_logprobs),
        ("bf16 vs fp32", "full forward, bf16", lp16),
    ):
        stats, valid = pair_stats(name, behaviour, "full forward, fp32", other, lp32, mask, cap=cap)
        pairs[name] = stats
        deltas[name] = valid.tolist()
    measured, skipped = [], {}
    for spec in precisions:
        sampling = dict(temperature=temperature, max_new_tokens=max_new_tokens, generator_seed=seed)
        why = _precision_pairs(
            model, tokenizer, prompt_ids, spec, samples_per_prompt, sampling, cap, pairs, deltas
        )
        if why is None:
            measured.append(spec)
        else:
            skipped[spec] = why
    result = MismatchResult(
        pairs=pairs,
        deltas=deltas,
        cap=float(cap),
        settings={
            "prompts": len(prompts),
            "samples_per_prompt": samples_per_prompt,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "sampler_dtype": sampler_dtype,
            "seed": seed,
            "mean_length": float(mask.sum(-1).float().mean()),
        },
        precisions=measured,
        skipped=skipped,
    )
    result.table = mismatch_table(result)
    if output_dir is not None:
        out = ensure_output_dir(output_dir)
        result.json_path = write_json(os.path.join(out, "mismatch.json"), result.to_dict())
        result.png_path = plot_mismatch(result, os.path.join(out, "mismatch.png"))
    return result


def _precision_pairs(
    model, tokenizer, prompt_ids, spec, group_size, sampling, cap, pairs, deltas
) -> str | None:
    """Sample and recompute in precision ``spec`` (module docstring); adds its two pairs to
    ``pairs`` / ``deltas``. Returns why the device cannot run it, or None when measured."""
    name = spec.removesuffix(HEAD_SUFFIX)
    device = next(model.parameters()).device
    why = unsupported_reason(name, device)
    if why is not None:
        return why
    precision = resolve_precision(name, device, lm_head_dtype="float32" if spec != name else None)
    net = model
    if precision.param_dtype != torch.float32 or precision.head_dtype is not None:
        net = copy.deepcopy(model).to(precision.param_dtype).eval()  # the caller's model stays as it is
        precision.prepare_head(net)
    was_training = model.training
    model.eval()
    try:
        engine = HFRolloutEngine(net, tokenizer, autocast=precision.autocast)
        rollout = engine.generate(prompt_ids, group_size=group_size, **sampling)
        scoring = {"temperature": sampling["temperature"], "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            with precision.autocast():
                trainer, _ = policy_logprobs(net, rollout, **scoring)
            exact, _ = policy_logprobs(model, rollout, **scoring)
    finally:
        model.train(was_training)
    mask = rollout.response_mask
    for pair, behaviour, behaviour_lp, target, target_lp in (
        (
            "sampler vs trainer",
            f"sampler ({spec}, KV cache)",
            rollout.sampler_logprobs,
            f"trainer ({spec})",
            trainer,
        ),
        ("trainer vs fp32", f"trainer ({spec})", trainer, "full forward, fp32", exact),
    ):
        key = f"{spec}: {pair}"
        pairs[key], valid = pair_stats(key, behaviour, target, behaviour_lp, target_lp, mask, cap=cap)
        deltas[key] = valid.tolist()
    return None


def plot_mismatch(result: MismatchResult, path: str) -> str:
    """Three panels: histogram of log10 |delta|; std of S_t vs t with sigma sqrt(t); std of W_t
    vs t with and without truncation."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.9))
    colors = {"sampler vs recompute": "#1f77b4", "bf16 vs fp32": "#d62728"}
    logs = {}
    for name, values in result.deltas.items():
        d = torch.tensor(values, dtype=torch.float64).abs()
        logs[name] = (d[d > 0].log10(), int((d == 0).sum()))
    nonempty = [v for v, _ in logs.values() if v.numel()]
    if nonempty:
        allv = torch.cat(nonempty)
        bins = torch.linspace(float(allv.min()), float(allv.max()) + 1e-9, 61).tolist()
        for name, (v, zeros) in logs.items():
            label = f"{name} (+{zeros} tokens with delta exactly 0)" if zeros else name
            axes[0].hist(v.tolist(), bins=bins, alpha=0.55, color=colors.get(name), label=label)
    axes[0].set(xlabel="log10 |log pi_train - log pi_other|", ylabel="tokens", title="Per-token mismatch")
    axes[0].legend(fontsize=7, loc="upper left")
    for name, p in result.pairs.items():
        c = colors.get(name)
        axes[1].plot(p.lengths, p.cum_std, color=c, label=f"{name}: std S_t")
        axes[1].plot(p.lengths, p.sigma_sqrt_t, ":", color=c, label="sigma sqrt(t)")
        axes[2].plot(p.lengths, p.seq_weight_std_t, color=c, label=f"{name}: W_t")
        axes[2].plot(
            p.lengths, p.seq_weight_std_t_truncated, "--", color=c, label=f"min(W_t, {result.cap:g})"
        )
    for ax in axes[1:]:
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    axes[1].set(
        xlabel="t (response tokens)", ylabel="std over sequences", title="Sequence log-ratio S_t vs length"
    )
    axes[2].set(
        xlabel="t (response tokens)", ylabel="std over sequences", title="Sequence weight W_t = exp(S_t)"
    )
    fig.tight_layout()
    return save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="policygrad lab mismatch",
        description="Per-token log-prob differences between the sampler (KV-cache decode) and the training "
        "recompute, and between bf16 and fp32 forwards; their growth with sequence length; truncated "
        "importance weights.",
    )
    p.add_argument("--model", default="bundled:smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=len(DEFAULT_PROMPTS), help="how many built-in prompts")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--sampler-dtype", default="float32", help="float32 or bfloat16 weights for the sampler")
    p.add_argument("--cap", type=float, default=2.0, help="importance-weight truncation")
    p.add_argument(
        "--precisions",
        default="",
        help="also measure these training precisions, comma-separated: fp32, bf16-mixed, fp16-mixed, "
        "bf16-pure, a mixed one with +fp32-head (e.g. fp32,bf16-mixed,bf16-mixed+fp32-head,fp16-mixed)",
    )
    add_run_args(p)
    return p


def main(argv: list[str]) -> str:
    """``policygrad lab mismatch ...``."""
    args = build_parser().parse_args(argv)
    set_threads(args.threads)
    if not 1 <= args.prompts <= len(DEFAULT_PROMPTS):
        raise ValueError(f"--prompts must be in 1..{len(DEFAULT_PROMPTS)}, got {args.prompts}")
    if args.sampler_dtype not in _DTYPES:
        raise ValueError(
            f"--sampler-dtype {args.sampler_dtype!r} is not valid; choose one of {', '.join(_DTYPES)}"
        )
    if not (math.isfinite(args.cap) and args.cap > 0):
        raise ValueError(f"--cap must be a finite number > 0, got {args.cap}")
    check_positive_int(args.samples_per_prompt, "--samples-per-prompt")
    check_positive_int(args.max_new_tokens, "--max-new-tokens")
    check_temperature(args.temperature)
    precisions = parse_precisions(args.precisions)
    output_dir = check_output_dir(args.output_dir)  # a file there is refused before the model loads
    model, tokenizer = load_lab_model(args.model)
    result = run_mismatch(
        model,
        tokenizer,
        DEFAULT_PROMPTS[: args.prompts],
        samples_per_prompt=args.samples_per_prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        sampler_dtype=args.sampler_dtype,
        cap=args.cap,
        seed=args.seed,
        precisions=precisions,
        output_dir=output_dir,
    )
    lines = [result.table]
    lines.append(f"\nwrote {result.json_path}\nwrote {result.png_path}")
    return "\n".join(lines)
