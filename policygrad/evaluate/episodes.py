"""Held-out evaluation of multi-turn episodes: greedy episodes' success (a final reward > 0),
turns, stop reasons and the environment's info, and pass@k over sampled episodes (Chen et al.
2021's unbiased estimator). ``policygrad eval --env`` and a run with an environment use it."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from policygrad.config.train import EnvConfig, ModelConfig, RewardConfig, RolloutConfig, TrainConfig
from policygrad.envs.base import STOP_REASONS
from policygrad.evaluate.single_turn import (
    EvaluationFailed,
    eval_engine,
    eval_output_path,
    pass_at_k,
    write_jsonl,
)
from policygrad.rollout.base import prompt_seed
from policygrad.trainer import build

__all__ = [
    "DEFAULT_ENV_DATASETS",
    "default_env_dataset",
    "episode_metrics",
    "evaluate_env_model",
    "evaluate_episodes",
    "failed_episodes",
]


DEFAULT_ENV_DATASETS = {
    "builtin:guess": "builtin:guess",
    "builtin:calculator": "builtin:arithmetic",
    "builtin:code_feedback": "builtin:code",
}


def default_env_dataset(env: str) -> str:
    """The dataset an environment is evaluated on by default: its built-in task's held-out rows
    (``builtin:arithmetic`` for environments of other rows)."""
    return DEFAULT_ENV_DATASETS.get(str(env).strip(), "builtin:arithmetic")


def _episode_records(episodes, finals: list[str]) -> list[dict[str, Any]]:
    """One JSON-ready record per episode of a batch (info: NaN, never given, as None)."""
    stops = episodes.stop_reasons
    records = []
    for i, final in enumerate(finals):
        reward = float(episodes.final_rewards[i])
        info = {}
        for key, values in episodes.info.items():
            v = float(values[i])
            info[key] = None if math.isnan(v) else v
        records.append({
            "transcript": episodes.transcripts[i] if episodes.transcripts else None,
            "final_answer": final,
            "final_reward": reward,
            "success": reward > 0,
            "stop_reason": stops[i],
            "turns": int(episodes.turns[i]),
            "failed": bool(episodes.failed[i]),
            "error": episodes.errors[i] if episodes.errors else None,
            "info": info,
        })
    return records


def _run_episodes(runner, rows, seeds, *, group_size: int, sampling, batch_size: int | None):
    """The episode records of ``group_size`` episodes per row (a row's contiguous),
    ``batch_size`` rows per :meth:`EpisodeRunner.run` call (None: all)."""
    step = batch_size or max(len(rows), 1)
    out: list[dict[str, Any]] = []
    for start in range(0, len(rows), step):
        _, _, episodes, finals = runner.run(
            rows[start : start + step],
            group_size=group_size,
            seeds=seeds[start : start + step],
            per_prompt_seeds=True,
            sampling=sampling,
        )
        out += _episode_records(episodes, finals)
    return out


def episode_metrics(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The summary of episode records (:func:`evaluate_episodes`'): ``success`` (fraction with
    final reward > 0), ``final_reward_mean``, ``turns_mean``, ``stop_<reason>`` for every reason of
    :data:`~policygrad.envs.base.STOP_REASONS` (they add up to 1), ``failed_frac`` and
    ``env/<key>``, the mean of each ``info`` key over the episodes that gave it, and
    ``turns_to_success`` (mean turns of the successful episodes; NaN when none succeeded)."""
    n = max(len(records), 1)
    won = [r["turns"] for r in records if r["success"]]
    metrics = {
        "success": sum(r["success"] for r in records) / n,
        "final_reward_mean": sum(r["final_reward"] for r in records) / n,
        "turns_mean": sum(r["turns"] for r in records) / n,
        **{f"stop_{s}": sum(r["stop_reason"] == s for r in records) / n for s in STOP_REASONS},
        "failed_frac": sum(r["failed"] for r in records) / n,
        "turns_to_success": sum(won) / len(won) if won else float("nan"),
    }
    for key in sorted({k for r in records for k in r["info"]}):
        given = [r["info"][key] for r in records if r["info"].get(key) is not None]
        if given:
            metrics[f"env/{key}"] = sum(given) / len(given)
    return metrics


@torch.inference_mode()
def evaluate_episodes(
    runner,
    rows: list[dict[str, Any]],
    *,
    samples: int = 1,
    ks: Sequence[int] = (),
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Multi-turn evaluation: one greedy episode per row and, with ``samples`` = n >= 2, n sampled
    episodes per row for pass@k. An episode succeeds when its final reward is > 0.

    Args:
        runner: an :class:`~policygrad.envs.episodes.EpisodeRunner` (its limits: ``max_turns``,
            ``max_new_tokens`` per turn, ``max_episode_tokens``).
        rows: dataset rows, each given to the environment's ``reset``.
        samples: n sampled episodes per row at ``temperature`` (0 or 1: greedy only).
        ks: the k of pass@k, each in 1 .. n (default [1, n]).
        seed: the root of every row's seed (its ``reset`` seed, the same for its greedy and
            sampled episodes, and of the sampling): the result depends on it, not on the global RNG.
        batch_size: rows per ``runner.run`` call (None: all in one).

    Returns:
        ``{"metrics": ..., "records": ...}``. ``metrics``: ``n`` (rows), the greedy episodes'
        :func:`episode_metrics` (``success``, ``final_reward_mean``, ``turns_mean``,
        ``stop_<reason>``, ``failed_frac``, ``env/<key>``) and, with samples, ``pass@k`` (the
        unbiased estimator over each row's successful sampled episodes, averaged over rows).
        ``records``: one per row, ``{"prompt", "answer"}`` of the row and its greedy episode's
        ``transcript``, ``final_answer`` (the last turn's text), ``final_reward``, ``success``,
        ``stop_reason``, ``turns``, ``failed``, ``error`` and ``info`` (the episode's mean of each
        key; None: never given), plus, with samples, ``samples``: the n sampled episodes' records.

    Raises:
        ValueError: a k outside 1 .. n.
    """
    if samples >= 2:
        ks = sorted(set(ks)) if ks else [1, samples]
        for k in ks:
            if not 1 <= k <= samples:
                raise ValueError(f"--k {k}: each k must be in 1 .. --samples {samples}")
    seeds = [prompt_seed(seed, i) for i in range(len(rows))]
    greedy = _run_episodes(
        runner, rows, seeds, group_size=1, sampling={"greedy": True, "temperature": 1.0},
        batch_size=batch_size,
    ) if rows else []
    records = [
        {"prompt": row.get("prompt"), "answer": row.get("answer"), **episode}
        for row, episode in zip(rows, greedy)
    ]
    metrics: dict[str, Any] = {"n": len(records), **episode_metrics(greedy)}
    if samples < 2 or not rows:
        return {"metrics": metrics, "records": records}
    sampled = _run_episodes(
        runner, rows, seeds, group_size=samples,
        sampling={"temperature": temperature, "top_p": 1.0, "top_k": 0}, batch_size=batch_size,
    )
    sums = dict.fromkeys([f"pass@{k}" for k in ks], 0.0)
    for i, rec in enumerate(records):
        rec["samples"] = sampled[i * samples : (i + 1) * samples]
        correct = sum(s["success"] for s in rec["samples"])
        for k in ks:
            sums[f"pass@{k}"] += pass_at_k(samples, correct, k)
    metrics.update({name: total / len(records) for name, total in sums.items()})
    return {"metrics": metrics, "records": records}


def failed_episodes(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How many of :func:`evaluate_episodes`' episodes failed in the environment (raised or timed
    out): ``failed`` of the greedy ones and, with samples, ``samples_failed`` of the sampled ones;
    ``first_error``: the first failed episode's error (greedy ones first), None when none failed.
    A failed episode counts as unsuccessful in ``success`` and pass@k. Every greedy episode failed
    (or every sampled one): there is nothing to report.

    Raises:
        EvaluationFailed: every greedy episode failed, or every sampled one did.
    """
    sampled = [s for r in records for s in r.get("samples", [])]
    out: dict[str, Any] = {"failed": sum(r["failed"] for r in records)}
    if sampled:
        out["samples_failed"] = sum(s["failed"] for s in sampled)
    out["first_error"] = next((r["error"] for r in [*records, *sampled] if r["failed"]), None)
    for what, group in (("greedy", records), ("sampled", sampled)):
        count = sum(r["failed"] for r in group)
        if group and count == len(group):
            first = next(r["error"] for r in group if r["failed"])
            raise EvaluationFailed(
                f"every one of the {count} {what} episodes failed in the environment, so there is no result "
                f"(the first: {first}); fix the environment (each episode's error is in the output file)"
            )
    return out


def evaluate_env_model(
    model: str,
    data,
    *,
    env: str,
    env_options: dict[str, Any] | None = None,
    limit: int,
    samples: int = 1,
    ks: Sequence[int] = (),
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    max_turns: int = 4,
    max_episode_tokens: int | None = None,
    batch_size: int | None = None,
    output: str | None = None,
    seed: int = 0,
    engine: str = "auto",
    adapter: str | None = None,
    rollout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``policygrad eval --env``: :func:`evaluate_episodes` on the first ``limit`` rows of
    ``data.eval_dataset``, with the engine and episode runner built as a training run builds them.

    Args:
        env, env_options: ``env.name`` and ``env.options``.
        max_new_tokens: the most tokens of one turn; ``max_turns``, ``max_episode_tokens``: the
            ``rollout.*`` episode limits.
        model, data, limit, output, engine, adapter, rollout: as :func:`evaluate_model`.
        samples, ks, temperature, seed, batch_size: as :func:`evaluate_episodes`.

    Returns:
        ``{"model", "env", "dataset", "engine", "n", "success", ..., "pass@k"..., "failed",
        "samples_failed" (with samples), "first_error", "output", "seconds", "load_seconds"}``
        (:func:`failed_episodes`: a failed episode counts as unsuccessful); ``output`` holds
        one record per row (:func:`evaluate_episodes`' records), written before any error below.

    Raises:
        EvaluationFailed: every greedy (or every sampled) episode failed in the environment.
        ConfigError: a bad engine, rollout or env field. ValueError / TypeError / OSError: a bad
            model, adapter, dataset or environment (or options it rejects), named.
    """
    # imported here: the factory imports the trainer loop, which imports this module

    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    output = eval_output_path(output, data.eval_dataset)
    cfg = TrainConfig(
        seed=seed,
        model=ModelConfig(name=model, adapter=adapter),
        data=data,
        rollout=RolloutConfig(
            engine=engine, max_new_tokens=max_new_tokens, max_turns=max_turns,
            max_episode_tokens=max_episode_tokens, **(rollout or {}),
        ),
        reward=RewardConfig(functions=[]),  # the environment's final reward is the score
        env=EnvConfig(name=env, options=dict(env_options or {})),
    )
    build.check_before_models(cfg)
    with eval_engine(cfg, limit) as (rows, models, gen, name, load_seconds):
        runner = build.build_environment(cfg, gen, models.tokenizer, models.policy)
        t0 = time.perf_counter()
        try:
            result = evaluate_episodes(
                runner, rows, samples=samples, ks=ks, temperature=temperature, seed=seed,
                batch_size=batch_size,
            )
        finally:
            runner.close()  # the environment workers, and whatever they forked
        seconds = time.perf_counter() - t0
    write_jsonl(output, result["records"])
    failed = failed_episodes(result["records"])
    return {
        "model": model,
        "env": env,
        "dataset": data.eval_dataset,
        "engine": name,
        **result["metrics"],
        **failed,
        "output": output,
        "seconds": round(seconds, 1),
        "load_seconds": round(load_seconds, 1),
    }
