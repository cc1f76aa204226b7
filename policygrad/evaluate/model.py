"""Evaluating a saved model (``policygrad eval``): the configuration of a training run that would
sample what is evaluated, the engine and held-out rows that run builds, :func:`evaluate` on them,
and the result written to a JSONL file that is never half-written."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from policygrad.config.agent import AgentConfig
from policygrad.config.train import EnvConfig, ModelConfig, RewardConfig, RolloutConfig, TrainConfig
from policygrad.data.sources import build_eval_rows
from policygrad.evaluate.evaluation import eval_sampler, evaluate
from policygrad.evaluate.scoring import AnswerFn, RewardFn, scoring_for
from policygrad.learn.health import check_finite_weights
from policygrad.rewards.code import TaskReward
from policygrad.rewards.verifiers import extract_answer
from policygrad.trainer import build
from policygrad.trainer.models import load_eval_models

__all__ = [
    "DEFAULT_ENV_DATASETS",
    "default_env_dataset",
    "eval_config",
    "eval_engine",
    "eval_output_path",
    "evaluate_model",
    "write_jsonl",
]

# The dataset ``policygrad eval --env`` evaluates on when no --dataset is given (held-out split).
DEFAULT_ENV_DATASETS = {
    "builtin:guess": "builtin:guess",
    "builtin:calculator": "builtin:arithmetic",
    "builtin:code_feedback": "builtin:code",
}


def default_env_dataset(env: str) -> str:
    """The dataset an environment is evaluated on by default: its built-in task's held-out rows
    (``builtin:arithmetic`` for environments of other rows)."""
    return DEFAULT_ENV_DATASETS.get(str(env).strip(), "builtin:arithmetic")


def write_jsonl(path: str, records: list[dict[str, Any]]) -> None:
    """One JSON object per line, written to a temporary file beside ``path`` and renamed over it,
    so ``path`` never holds half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.filename is None:  # a failed write names no file (a full disk)
            raise OSError(e.errno, e.strerror, path) from e
        raise


def eval_output_path(output: str | None, dataset: str | None) -> str:
    """Where ``policygrad eval`` writes its completions, checked before any model loads.

    Args:
        output: the ``--output`` file, or None for ``eval-<dataset stem>.jsonl`` in the working
            folder.
        dataset: the evaluated dataset spec (a path, a Hub id or ``builtin:NAME``).

    Returns:
        the output path, absolute: code run during the evaluation (an environment, a reward
        function) that changes the working directory cannot move where the results are written.

    Raises:
        ValueError: ``output`` is a folder, its folder does not exist or is not writable, or it
            names the dataset file being read (names ``--output`` and the fix).
    """
    if output is None:
        stem = os.path.splitext(os.path.basename(dataset or "builtin"))[0].replace(":", "-")
        output = f"eval-{stem}.jsonl"
    if os.path.isdir(output):
        raise ValueError(f"--output {output} is a folder; give a file, e.g. {output}/eval.jsonl")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise ValueError(f"--output {output}: folder {folder} does not exist; create it or give another path")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--output {output}: folder {folder} is not writable; give another path")
    if dataset and os.path.exists(output) and os.path.exists(dataset):
        inputs = [dataset] if os.path.isfile(dataset) else [
            os.path.join(dataset, name) for name in os.listdir(dataset)
        ]
        if any(os.path.samefile(output, path) for path in inputs if os.path.isfile(path)):
            raise ValueError(
                f"--output {output} is the dataset being evaluated; give another file for the results"
            )
    return os.path.abspath(output)


def eval_config(
    model: str,
    data,
    *,
    seed: int = 0,
    engine: str = "auto",
    adapter: str | None = None,
    max_new_tokens: int = 256,
    env: str | None = None,
    env_options: dict[str, Any] | None = None,
    agent: str | None = None,
    max_turns: int = 4,
    max_episode_tokens: int | None = None,
    rollout: dict[str, Any] | None = None,
) -> TrainConfig:
    """The configuration of a training run whose engine, rows and sampler an evaluation uses.

    Args:
        model: ``model.name`` (a full model or a LoRA adapter folder, see
            :mod:`policygrad.models.adapters`); ``adapter``: ``model.adapter``.
        data: a :class:`~policygrad.config.train.DataConfig` (``eval_dataset``, its split and
            field mapping).
        engine: ``auto`` (vLLM when installed), ``hf`` or ``vllm``; ``rollout``: other
            ``rollout.*`` fields (e.g. ``vllm_kv_cache_gb``).
        max_new_tokens: the most tokens of a completion (with ``env``: of one turn).
        env, env_options: ``env.name`` and ``env.options`` (None: single-turn completions);
            ``agent``: ``agent.function`` instead; ``max_turns``, ``max_episode_tokens``: the
            ``rollout.*`` episode limits.

    Raises:
        ConfigError: a bad engine, rollout or env field.
    """
    multi_turn = env is not None or agent is not None
    episodes = {"max_turns": max_turns, "max_episode_tokens": max_episode_tokens} if multi_turn else {}
    return TrainConfig(
        seed=seed,
        model=ModelConfig(name=model, adapter=adapter),
        data=data,
        rollout=RolloutConfig(engine=engine, max_new_tokens=max_new_tokens, **episodes, **(rollout or {})),
        # An environment's final reward is the score; rows of any kind are judged by their verifier.
        reward=RewardConfig(functions=[] if multi_turn else list(TaskReward.functions)),
        **({"env": EnvConfig(name=env, options=dict(env_options or {}))} if env is not None else {}),
        **({"agent": AgentConfig(function=agent)} if agent is not None else {}),
    )


@contextlib.contextmanager
def eval_engine(cfg, limit: int):
    """``(rows, models, engine, engine name, load seconds)`` of an evaluation: the first ``limit``
    held-out rows, the model and the engine a training run of ``cfg`` would build; the engine is
    closed on exit."""
    t_load = time.perf_counter()
    rows = build_eval_rows(cfg.data, seed=cfg.seed, at_most=True)[:limit]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = build.resolve_dtype(cfg.model.dtype, device)
    models = load_eval_models(cfg, device=device, dtype=dtype)
    # A NaN weight makes every completion noise (greedy decoding of NaN logits picks arbitrary
    # tokens): an accuracy of 0 would be reported for a model that was never evaluated.
    what = f"--model {cfg.model.name}" + (f" with --adapter {cfg.model.adapter}" if cfg.model.adapter else "")
    check_finite_weights(models.policy, what, use="evaluated")
    gen, name = build.build_engine(cfg, models, dtype=dtype, quiet=True, engine_option="--engine")
    try:
        if models.weights_differ_from_path:
            gen.sync_weights(models.policy)  # an engine with its own weights loaded the base
        yield rows, models, gen, name, time.perf_counter() - t_load
    finally:
        close = getattr(gen, "close", None)
        if callable(close):
            close()


def evaluate_model(
    cfg: TrainConfig,
    *,
    limit: int,
    output: str | None = None,
    samples: int = 1,
    ks: Sequence[int] = (),
    temperature: float = 1.0,
    batch_size: int | None = None,
    reward_fn: RewardFn | None = None,
    answer_fn: AnswerFn | None = extract_answer,
) -> dict[str, Any]:
    """``policygrad eval``: :func:`~policygrad.evaluate.evaluation.evaluate` on the first
    ``limit`` rows of ``cfg.data.eval_dataset`` (all of them when it has fewer), with the engine
    (and with ``env.name``, the episode runner) built as a training run of ``cfg`` builds them
    (:func:`eval_config`), sampled from ``cfg.seed``.

    Args:
        output: JSONL of every row's record (default ``eval-<dataset>.jsonl``).
        samples, ks, temperature, batch_size, reward_fn, answer_fn: as
            :func:`~policygrad.evaluate.evaluation.evaluate`.

    Returns:
        ``{"model", "env" (with an environment), "dataset", "engine", "n", <metrics>..., "output",
        "seconds" (generation and scoring), "load_seconds" (model and engine)}``; with an
        environment, also ``failed``, ``samples_failed`` (with samples) and ``first_error``
        (:func:`~policygrad.evaluate.scoring.failed_episodes`: a failed episode counts as
        unsuccessful). ``output`` holds one record per row, written before any error below.

    Raises:
        EvaluationFailed: every greedy (or every sampled) episode failed in the environment, or a
            completion came from NaN logits.
        ConfigError: a bad engine, rollout or env field. ValueError / TypeError / OSError /
            FileNotFoundError: a bad model, adapter, dataset or environment (or options it
            rejects), named.
    """
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    output = eval_output_path(output, cfg.data.eval_dataset)
    env = cfg.env.name
    if env:
        build.check_before_models(cfg)
    with eval_engine(cfg, limit) as (rows, models, gen, name, load_seconds):
        runner = build.build_environment(cfg, gen, models.tokenizer, models.policy) if env else None
        sampler = eval_sampler(cfg, gen, models.tokenizer, runner)
        t0 = time.perf_counter()
        try:
            metrics, records = evaluate(
                sampler, rows, reward_fn=reward_fn, answer_fn=answer_fn, seed=cfg.seed, samples=samples,
                ks=ks, temperature=temperature, batch_size=batch_size,
            )
        finally:
            if runner is not None:
                runner.close()  # the environment workers, and whatever they forked
        seconds = time.perf_counter() - t0
    write_jsonl(output, records)
    return {
        "model": cfg.model.name,
        **({"agent": cfg.agent.function} if cfg.agent.function else {"env": env} if env else {}),
        "dataset": cfg.data.eval_dataset,
        "engine": name,
        "n": len(records),
        **metrics,
        **scoring_for(sampler).outcome(records),
        "output": output,
        "seconds": round(seconds, 1),
        "load_seconds": round(load_seconds, 1),
    }
