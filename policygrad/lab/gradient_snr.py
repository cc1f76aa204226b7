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
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from policygrad.arguments import OneLineArgumentParser, check_temperature
from policygrad.core.diagnostics import explained_variance
from policygrad.core.kl import last_token_rewards
from policygrad.data.sources import resolve_dataset
from policygrad.lab.common import (
    DEFAULT_OUTPUT_DIR,
    add_run_args,
    check_output_dir,
    check_positive_int,
    ensure_output_dir,
    load_lab_model,
    repeat_each,
    set_threads,
    tokenize_user_prompts,
    write_json,
)
from policygrad.lab.gradient_snr_estimators import (
    DEFAULT_ESTIMATORS,
    EstimatorSpec,
    HeadInput,
    LinearCritic,
    estimator_gradients,
    parameter_pattern,
    parse_estimators,
    select_parameters,
    whole_row_logprobs,
)
from policygrad.lab.gradient_snr_stats import (
    Accumulator,
    GradientSNRResult,
    plot_snr,
    snr_table,
)
from policygrad.rewards.verifiers import answer_correctness
from policygrad.rollout.base import decode_completions
from policygrad.rollout.hf import HFRolloutEngine

RewardFn = Callable[..., Sequence[float]]


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
        hook = HeadInput(model)
        try:
            with torch.no_grad():
                whole_row_logprobs(model, rollout, temperature)
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

    # imported here: the progress bar loads only when draws are taken
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
        ref_acc = Accumulator(num_params)
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

        accs = [Accumulator(num_params) for _ in specs]
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
