"""Every metric a run logs, defined once: :data:`METRICS` maps each name to its meaning, and the
functions here compute the step's metrics from the step's records.

Names follow the field's terms (``reward/mean``, ``kl/ref``, ``policy/clipfrac``,
``policy/approx_kl``, ``critic/explained_variance``, ``time/generation_s``). A name with ``<fn>``
stands for each reward function's component name, ``<k>`` for a number. The docs' metrics
reference (docs/metrics.md) is checked against this table by a test.

Trackers (``report_to``) get the same names through :func:`tracker_metric_name`, the one place
that maps a name to what a tracker accepts.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from policygrad.core.diagnostics import explained_variance, mean_value, std_value
from policygrad.core.groups import zero_variance_group_fraction
from policygrad.core.masking import masked_mean
from policygrad.parallel.runtime import peak_rss_gb

__all__ = [
    "METRICS",
    "batch_metrics",
    "critic_metrics",
    "episode_metrics",
    "is_known_metric",
    "mean_value",
    "mismatch_metrics",
    "perf_metrics",
    "tracker_metric_name",
]

METRICS: dict[str, str] = {
    # rewards
    "reward/mean": "mean return (sequence score, normalised, truncation policy applied, plus an episode's "
    "turn rewards) over the sampled rows scored",
    "reward/std": "standard deviation of the sampled rows' returns",
    "reward/score": "mean return of the rows trained on, failed rows filled with their group's mean return",
    "reward/score_raw_mean": "mean raw return: the reward functions' weighted sum plus an environment's "
    "final and turn rewards, before normalisation and the truncation policy",
    "reward/non_score": "mean over sequences of the KL part of the per-token reward (0 without a KL reward)",
    "reward/valid_frac": "fraction of rows that may carry loss (reward computed, not excluded as truncated)",
    "reward/invalid_frac": "fraction of rows on which a reward function failed (on_error=skip)",
    "reward/zero_variance_group_frac": "fraction of sampled groups whose returns are all equal",
    "reward_fn/<fn>/mean": "mean raw score of one reward function over the rows where it succeeded",
    "reward_fn/<fn>/invalid": "rows on which one reward function failed",
    # dynamic sampling
    "dynamic_sampling/groups_sampled": "groups generated this step, over all rounds",
    "dynamic_sampling/groups_kept": "groups with signal in dynamic_sampling.reward (with an environment: the "
    "raw return) that the update trains on",
    "dynamic_sampling/rounds": "generation rounds this step (1 + extra rounds used to refill the batch)",
    # VinePPO's Monte-Carlo values (advantage estimator vineppo)
    "vineppo/extra_tokens": "tokens generated for the value rollouts this step, beyond the batch's",
    "vineppo/extra_sequences": "value rollouts sampled this step (K per state)",
    "vineppo/splits_mean": "mean split points per response (states inside it whose value is estimated)",
    # responses
    "response/length_mean": "mean response length in tokens (the first EOS included)",
    "response/length_max": "longest response in tokens",
    "response/truncated_frac": "fraction of responses cut at max_new_tokens without EOS",
    # advantages and returns
    "advantages/mean": "mean advantage over the tokens that carry loss",
    "returns/mean": "mean return (the critic's target) over valid tokens",
    # KL
    "kl/ref": "mean k1 KL to the reference per valid token, from the behaviour log-probs",
    "kl/coef": "beta of this step (the KL controller's value)",
    "kl/loss_term": "mean per-token KL term of the loss (KL placement loss)",
    # policy update
    "policy/loss": "mean over applied optimizer steps of the policy loss",
    "policy/clipfrac": "fraction of valid tokens whose gradient the clip removed",
    "policy/clipfrac_low": "fraction of tokens clipped at 1 - clip_low (A < 0)",
    "policy/clipfrac_high": "fraction of tokens clipped at 1 + clip_high (A > 0)",
    "policy/clipfrac_dual": "fraction of tokens in the dual clip's constant region",
    "policy/approx_kl": "mean k3 estimate of KL(pi_old || pi) over the update's tokens",
    "policy/ratio_mean": "mean importance ratio pi / pi_old",
    "policy/ratio_max": "largest importance ratio pi / pi_old",
    "policy/entropy": "mean entropy of the sampled distribution per valid token",
    "policy/positive_lm_nll": "mean NLL of the positive samples' tokens (loss.positive_lm_coef)",
    "policy/positive_frac": "fraction of the update's tokens in positive samples (loss.positive_lm_coef)",
    # entropy (Cui et al. 2025: the covariance of log-prob and advantage drives its change)
    "entropy/mean": "mean entropy per valid token of the policy before the step's first optimizer step",
    "entropy/cov": "covariance of sampled log-prob and advantage over valid tokens (> 0 lowers entropy)",
    "entropy/coef": "the entropy bonus's coefficient this step (loss.entropy_coef or its adaptive value)",
    "entropy/cov_selected_frac": "fraction of tokens the clip_cov / kl_cov loss acted on",
    "policy/nonfinite_tokens": "sampled tokens the trainer gives log-prob -inf (left out of the loss)",
    "optim/skipped_rows_frac": "fraction of the update's rows not forwarded (every advantage 0: no gradient)",
    "optim/steps": "policy optimizer steps applied this step",
    "optim/skipped_nonfinite": "policy optimizer steps skipped for a non-finite loss or gradient",
    "optim/grad_norm": "mean gradient norm before clipping",
    "optim/lr": "the policy's learning rate after this step",
    "optim/early_stopped": "1 when optim.target_kl stopped the update",
    "optim/loss_scale": "fp16-mixed's dynamic loss scale after this step (halved at each skipped step)",
    "ptx/loss": "mean PPO-ptx language-modelling loss",
    # critic
    "critic/vf_loss": "token-weighted value loss of the critic steps",
    "critic/vf_clipfrac": "fraction of tokens whose clipped value error was used",
    "critic/explained_variance": "explained variance of the rollout-time values against the targets",
    "critic/values_mean": "mean rollout-time value over valid tokens",
    "critic/pretraining": "1 while only the critic trains (critic.pretrain_steps)",
    "critic/steps": "critic optimizer steps applied",
    "critic/skipped_nonfinite": "critic optimizer steps skipped for a non-finite loss or gradient",
    "critic/grad_norm": "mean critic gradient norm before clipping",
    "critic/lr": "the critic's learning rate after this step",
    # sampler / trainer mismatch
    "mismatch/logprob_abs_mean": "mean |log-prob of the trainer - of the sampler| per token, same weights",
    "mismatch/logprob_abs_max": "largest per-token |log-prob difference| between trainer and sampler",
    "mismatch/seq_log_ratio_std": "std over sequences of the summed log-ratio trainer / sampler",
    "mismatch/seq_ratio_min": "smallest sequence ratio pi_trainer / pi_sampler",
    "mismatch/seq_ratio_max": "largest sequence ratio pi_trainer / pi_sampler",
    "mismatch/is_weight_mean": "mean truncated importance weight applied (rollout.is_correction)",
    "mismatch/is_capped_frac": "fraction of tokens whose importance ratio exceeded rollout.is_cap",
    "mismatch/is_floored_frac": "fraction of tokens whose importance ratio fell below rollout.is_floor",
    # rollouts sampled ahead (rollout.max_staleness > 0); mismatch/* then compare the proximal
    # policy (the trainer at the start of the step) with the behaviour policy (the sampler)
    "async/staleness": "updates between the weights that sampled this step's batch and the step",
    "async/queue": "batches sampled ahead, finished and waiting, after this step took its own",
    "async/overlap": "1 - generation_wait_s / generation_s: the generation hidden behind training",
    "async/behaviour_kl": "k1 KL(behaviour || proximal): sampler minus trainer log-prob at step start",
    "time/generation_wait_s": "seconds the trainer waited for rollouts (its batch, then the drain)",
    # evaluation
    "eval/accuracy": "greedy held-out accuracy (answer correctness)",
    "eval/pass@<k>": "held-out pass@k from eval_samples samples per problem (unbiased estimator)",
    "eval/maj@<k>": "held-out maj@k: the majority answer of k samples is correct",
    # resume
    "eval/turns_mean": "held-out greedy episodes' mean turns (runs with an environment)",
    "eval/turns_to_success": "held-out greedy episodes' mean turns among the successful ones (NaN: none)",
    "eval/env/<info>": "held-out greedy episodes' mean of StepResult.info[<info>] (runs with an environment)",
    "config/<field>": "an option changed on resume (optim.lr, ...): its new value, at the step resumed from",
    # multi-turn episodes (env.name)
    "episode/turns_mean": "mean policy turns per episode",
    "episode/stop_<reason>": "fraction of episodes that stopped for <reason>: done, max_turns, length, "
    "budget, context or error",
    "episode/action_tokens_mean": "mean tokens the policy wrote per episode (what the loss counts)",
    "episode/observation_tokens_mean": "mean environment tokens per episode (seen, never trained on)",
    "episode/restarts_mean": "mean times an episode's history restarted (an agent's call that rewrote it): "
    "each leaves a segment row trained with the episode's advantage",
    "env/turn_reward_mean": "mean over episodes of the sum of their turn rewards as trained (0 on rows left "
    "out: failed, or cut under reward.truncation=penalty)",
    "env/final_reward_mean": "mean final reward over the episodes that did not fail",
    "env/failed_frac": (
        "fraction of episodes whose environment raised, timed out or died, after their retries "
        "(no loss on them)"
    ),
    "env/retries": "fresh attempts made for episodes that failed in the environment (rollout.env_retries)",
    "env/groups_dropped": (
        "groups left out of the batch whole because an episode of theirs failed after its retries"
    ),
    "env/close_errors": "episodes whose environment's close() failed",
    "env/<info>": "mean over episodes of each episode's mean of StepResult.info[<info>]",
    # time, throughput, memory (volatile: they differ between identical runs)
    "time/generation_s": "seconds sampling and scoring (with ReMax's greedy baseline, VinePPO's rollouts)",
    "time/vineppo_s": "seconds sampling and scoring VinePPO's value rollouts (part of generation)",
    "time/ref_logprobs_s": "seconds of the reference log-prob pass (0: not needed)",
    "time/old_logprobs_s": "seconds of the old log-prob pass (0: exactly on-policy)",
    "time/forward_s": "seconds of the policy's training forwards",
    "time/backward_s": "seconds of the policy's backward passes",
    "time/optimizer_s": "seconds of gradient clipping and optimizer steps",
    "time/env_s": "seconds in environment calls (reset, step, final_reward, close)",
    "time/weight_sync_s": "seconds pushing the updated weights into a separate rollout engine",
    "time/training_s": "seconds from the end of generation to the end of the update",
    "time/step_s": "seconds of the whole step",
    "perf/tokens_per_s": "response tokens of the step per second of the step",
    "perf/threads": "torch's intra-op threads during the step (num_threads, or the count fitted to the load)",
    "memory/peak_rss_gb": "peak resident memory of the process, GB",
    "memory/peak_cuda_gb": "peak CUDA memory allocated, GB",
}

# A component is named by its spec, which may be a file path: ``<fn>`` matches any text; ``<k>``
# a number; ``<field>`` a dotted config field; ``<reason>`` a stop reason; ``<info>`` an info key.
_PLACEHOLDERS = {"<fn>": ".+", "<k>": "[0-9]+", "<field>": ".+", "<reason>": "[a-z_]+", "<info>": ".+"}


def _pattern(name: str) -> re.Pattern:
    text = re.escape(name)
    for placeholder, regex in _PLACEHOLDERS.items():
        text = text.replace(re.escape(placeholder), regex)
    return re.compile("^" + text + "$")


_PATTERNS = [_pattern(name) for name in METRICS if any(p in name for p in _PLACEHOLDERS)]


def is_known_metric(name: str) -> bool:
    """True when ``name`` is in :data:`METRICS` (a ``<fn>`` entry matching any component name,
    ``<k>`` any number)."""
    return name in METRICS or any(p.match(name) for p in _PATTERNS)


# MLflow accepts only these characters in a metric name; the others become "_" ("eval/pass@8" ->
# "eval/pass_8", a reward component "/x/rewards.py:f" -> "x/rewards.py_f"). TensorBoard, W&B and
# trackio take any name; "/" groups the charts of a section in each of them.
_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")


def _mlflow_name(name: str) -> str:
    # MLflow also refuses a name that is not its own normal path: no empty, "." or ".." segment.
    parts = [p if p != ".." else "__" for p in _MLFLOW_UNSAFE.sub("_", name).split("/") if p not in ("", ".")]
    return "/".join(parts)


_TRACKER_NAMES = {"mlflow": _mlflow_name}


def tracker_metric_name(tracker: str, name: str) -> str:
    """The name under which ``tracker`` (``tensorboard``, ``wandb``, ``mlflow``, ``trackio``)
    records the metric ``name``."""
    convert = _TRACKER_NAMES.get(tracker)
    return convert(name) if convert else name


def mismatch_metrics(logprobs, rows, rollout, response_mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler's log-probs are from the trainer's for the same tokens and weights
    (the train/inference mismatch, Yao et al. 2025): mean and max per-token absolute difference,
    and the spread of the sequence-level ratio exp(sum_t (lp - lp_sampler)).

    Args:
        logprobs: [B, T] the trainer's log-probs before the update, or None (no metrics).
        rows: bool [B] rows for which ``logprobs`` were recorded, or None (all).
        rollout: the step's rollout (``sampler_logprobs``).
        response_mask: [B, T] float.
    """
    if logprobs is None:
        return {}
    mask = response_mask > 0
    if rows is not None:
        mask = mask & rows[:, None]
    if not mask.any():
        return {}
    diff = torch.where(mask, logprobs.float() - rollout.sampler_logprobs.float(), 0.0)
    seq = diff.sum(-1)[mask.any(-1)]
    return {
        "mismatch/logprob_abs_mean": masked_mean(diff.abs(), mask.float()).item(),
        "mismatch/logprob_abs_max": diff.abs().max().item(),
        "mismatch/seq_log_ratio_std": seq.std().item() if seq.numel() > 1 else 0.0,
        "mismatch/seq_ratio_min": seq.min().exp().item(),
        "mismatch/seq_ratio_max": seq.max().exp().item(),
    }


def critic_metrics(values, returns, critic_mask, response_mask, *, pretraining: bool) -> dict[str, float]:
    """Explained variance of the rollout-time values against the targets, their mean, and
    whether the step only pretrained the critic (empty without a critic)."""
    if values is None:
        return {}
    ev = explained_variance(values, returns, critic_mask) if critic_mask.any() else float("nan")
    return {
        "critic/explained_variance": float(ev),
        "critic/values_mean": _masked_mean_value(values, response_mask),
        "critic/pretraining": float(pretraining),
    }


def batch_metrics(
    scores, rollout, *, advantages, loss_mask, returns, response_mask, sample_returns=None
) -> dict[str, Any]:
    """Reward, response-length, advantage and return statistics of a step.

    Args:
        scores: the sampled rows' :class:`~policygrad.rewards.scoring.Scores`.
        rollout: the sampled rows' rollout.
        advantages, loss_mask, returns, response_mask: [B, T] of the trained rows.
        sample_returns: float32 [B], each sampled row's return as trained
            (:attr:`~policygrad.produce.stages.SampledBatch.returns`: the score plus an episode's
            turn rewards), what the reward statistics are of; None: ``scores.scores``.
    """
    s = scores.scores if sample_returns is None else sample_returns
    failed = scores.failed
    lengths = rollout.response_mask.sum(-1)
    return {
        "reward/mean": mean_value(s[~failed]) if (~failed).any() else float("nan"),
        "reward/std": std_value(s),
        "reward/score_raw_mean": mean_value(scores.raw),
        "reward/valid_frac": scores.valid.float().mean().item(),
        "reward/zero_variance_group_frac": float(zero_variance_group_fraction(s, rollout.group_index)),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/truncated_frac": rollout.truncated.float().mean().item(),
        "advantages/mean": _masked_mean_value(advantages, loss_mask) if loss_mask.any() else 0.0,
        "returns/mean": _masked_mean_value(returns, response_mask),
    }


def _masked_mean_value(values: torch.Tensor, mask: torch.Tensor) -> float:
    """``masked_mean(values, mask)`` as a Python float, in float64 when float32's accumulation
    overflowed on finite values (returns near float32's range), as :func:`mean_value`."""
    out = masked_mean(values, mask).item()
    if not math.isfinite(out):
        chosen = values[mask > 0]
        if chosen.numel() and bool(torch.isfinite(chosen).all()):
            out = masked_mean(values.double(), mask.double()).item()
    return out


def metrics_markdown() -> str:
    """The docs' metric table (docs/metrics.md), generated from :data:`METRICS` (a test keeps them equal)."""
    lines = ["| metric | meaning |", "|:--|:--|"]
    escape = str.maketrans({"<": "&lt;", ">": "&gt;"})  # "<reason>" is text, not a tag, in a page
    lines += [f"| `{name}` | {meaning.translate(escape)} |" for name, meaning in METRICS.items()]
    return "\n".join(lines)


def episode_metrics(episodes, rollout) -> dict[str, float]:
    """The ``episode/*``, ``env/*`` and ``time/env_s`` metrics of a batch of episodes
    (:class:`~policygrad.envs.episodes.Episodes` and their :class:`~policygrad.rollout.base.Rollout`)."""
    from policygrad.envs.base import STOP_REASONS  # the trainer's layer imports envs; metrics stays light

    count = max(len(episodes.stop), 1)
    failed = episodes.failed
    ok = ~failed
    observed = rollout.observation_mask
    actions = rollout.response_mask.sum(-1).float()
    seen = observed.sum(-1).float() if observed is not None else None
    earlier = episodes.earlier_tokens
    if earlier is not None and bool(earlier.any()):  # an episode's earlier segments count too
        actions = actions + earlier[:, 0].to(actions)
        seen = (seen if seen is not None else torch.zeros_like(actions)) + earlier[:, 1].to(actions)
    out = {
        "episode/turns_mean": episodes.turns.float().mean().item(),
        "episode/action_tokens_mean": actions.mean().item(),
        "episode/observation_tokens_mean": seen.mean().item() if seen is not None else 0.0,
        "episode/restarts_mean": (
            episodes.restarts.float().mean().item() if episodes.restarts is not None else 0.0
        ),
        "env/turn_reward_mean": mean_value(episodes.turn_rewards.sum(-1)),
        "env/final_reward_mean": mean_value(episodes.final_rewards[ok]) if ok.any() else float("nan"),
        "env/failed_frac": failed.float().mean().item(),
        "env/retries": float(episodes.retries),
        "env/close_errors": float(episodes.close_errors),
        "time/env_s": float(episodes.env_seconds),
    }
    for i, reason in enumerate(STOP_REASONS):
        out[f"episode/stop_{reason}"] = float((episodes.stop == i).sum().item()) / count
    for key, values in episodes.info.items():
        given = ~torch.isnan(values)
        out[f"env/{key}"] = values[given].mean().item() if given.any() else float("nan")
    return out


def async_metrics(step, batch, exp, stats, production, waited, queue, times, total=float) -> dict[str, float]:
    """The metrics of a step whose batch came from the rollout pipeline: its staleness, the
    finished batches waiting, the trainer's wait (for its batch, then the drain after the update)
    and the share of generation it hid, the weight push, and the k1 KL between the behaviour
    policy (the sampler's log-probs) and the proximal one (the old log-probs recomputed at the
    start of the step, or the first forward's when the batch was on-policy).

    Args:
        step: m; batch: the step's :class:`SampledBatch` (``version``); exp: its experience;
        stats: the update's :class:`UpdateStats`; production: the pipeline's record (``seconds``);
        waited, queue: from :meth:`Rollouts.take`; times: from :meth:`Rollouts.after_update`;
        total: a local sum -> the sum over ranks (``Dist.total``), so the KL is of the global batch.
    """
    wait = waited + times.get("time/drain_wait_s", 0.0)
    metrics = {
        "async/staleness": float(step - batch.version),
        "async/queue": float(queue),
        "time/generation_wait_s": wait,
        "async/overlap": min(1.0, max(0.0, 1.0 - wait / production.seconds))
        if production.seconds > 0
        else 0.0,
    }
    if "time/weight_sync_s" in times:
        metrics["time/weight_sync_s"] = times["time/weight_sync_s"]
    # UpdateStats holds the proximal log-probs: the recomputed old ones, or the first forward's
    # over the rows it recorded (rollout_rows) when the batch was on-policy.
    proximal, rows = stats.rollout_logprobs, stats.rollout_rows
    if proximal is not None:
        mask = exp.rollout.response_mask > 0
        if rows is not None:
            mask = mask & rows[:, None]
        diff = torch.where(mask, exp.rollout.sampler_logprobs.float() - proximal.float(), 0.0)
        count = total(mask.sum().double())
        if count > 0:
            metrics["async/behaviour_kl"] = total(diff.double().sum()) / count
    return metrics


def perf_metrics(exp, seconds: float, threads: int) -> dict[str, float]:
    """Tokens per second of a step of ``seconds`` (the trained rows' policy tokens, ``exp``: an
    :class:`~policygrad.learn.experience.Experience`), torch's thread count and the peak memory."""
    tokens = int(exp.rollout.response_mask.sum().item())
    out = {"perf/tokens_per_s": tokens / max(seconds, 1e-9), "perf/threads": threads}
    out["memory/peak_rss_gb"] = peak_rss_gb()
    if torch.cuda.is_available():
        out["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out
