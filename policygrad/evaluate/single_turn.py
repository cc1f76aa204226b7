"""Evaluation, one implementation for the trainer and ``policygrad eval``: greedy accuracy of a
policy on held-out rows, and from n sampled completions per row pass@k (the unbiased estimator
of Chen et al. 2021) and maj@k (majority vote over the extracted answers) for any k <= n.

Every problem goes to the rollout engine in one ``generate`` call (``batch_size`` caps it):
vLLM schedules the whole set itself, the hf engine decodes it as one padded batch.

Two hooks choose what is scored (for tasks other than answer matching, e.g. code tests):
``reward_fn(prompts, completions, **row_fields) -> list[float]`` (a completion is correct when
its reward is > 0.5; default :func:`~policygrad.rewards.verifiers.answer_correctness`) and
``answer_fn(completion) -> str | None`` (the answer that maj@k votes on; default
:func:`~policygrad.rewards.verifiers.extract_answer`; None reports no maj@k).

With an environment (:mod:`policygrad.envs`), :func:`evaluate_episodes` plays one greedy episode
per row (and n sampled ones for pass@k) through an episode runner: success is a final reward > 0.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from policygrad.config.train import ModelConfig, RewardConfig, RolloutConfig, TrainConfig
from policygrad.data.chat import encode_prompts
from policygrad.data.sources import build_eval_rows
from policygrad.errors import TrainingError
from policygrad.learn.health import check_finite_weights
from policygrad.rewards.code import TaskReward
from policygrad.rewards.registry import row_fields_from_rows
from policygrad.rewards.verifiers import answer_correctness, extract_answer
from policygrad.rollout.base import decode_completions
from policygrad.trainer import build
from policygrad.trainer.models import load_eval_models

__all__ = [
    "EvaluationFailed",
    "decode_completions",
    "eval_engine",
    "eval_output_path",
    "evaluate",
    "evaluate_model",
    "greedy_eval",
    "majority_at_k",
    "pass_at_k",
    "sample_completions",
    "score_completions",
    "write_jsonl",
]

RewardFn = Callable[..., Sequence[float]]
AnswerFn = Callable[[str], "str | None"]


class EvaluationFailed(TrainingError):
    """Every item of an evaluation failed (e.g. every episode's environment raised): there is no
    result to report, so ``policygrad eval`` ends with one ``error:`` line and status 2 instead of
    a summary of zeros."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1).

    Raises:
        ValueError: k > n, or c outside [0, n].
    """
    if not 0 <= c <= n:
        raise ValueError(f"c={c} must be in [0, n={n}]")
    if k > n:
        raise ValueError(f"k={k} must be <= n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """maj@k of one problem from n >= k samples: the mean, over the n // k disjoint blocks of k
    consecutive samples (each an independent draw of k samples), of whether the block's most
    frequent answer is correct. A tie goes to the answer seen first; samples without an answer
    do not vote; a block where none answers counts as wrong.

    Args:
        answers: the n extracted answers (None: no answer).
        correct: the n verdicts; samples with the same answer share it.

    Raises:
        ValueError: k < 1 or k > n, or the lengths differ.
    """
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"{n} answers but {len(correct)} verdicts")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in 1 .. n={n}")
    blocks = n // k
    hits = 0
    for b in range(blocks):
        votes = [(a, ok) for a, ok in zip(answers[b * k : (b + 1) * k], correct[b * k : (b + 1) * k])]
        counts = Counter(a for a, _ in votes if a is not None)
        if not counts:
            continue
        best = max(counts.values())
        winner = next(a for a, _ in votes if a is not None and counts[a] == best)
        hits += next(ok for a, ok in votes if a == winner)
    return hits / blocks


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


def sample_completions(
    engine, tokenizer, rows, *, data, n: int, greedy: bool, temperature: float, max_new_tokens: int,
    batch_size: int | None, seed: int,
) -> list[str]:
    """n completions per row (rows' completions contiguous), ``batch_size`` rows per call (None: all);
    sampled (``greedy`` False) with a per-call seed derived from ``seed``, so the same seed draws the
    same completions (``policygrad eval --samples`` and ``policygrad lab passk`` share it)."""
    prompt_ids = encode_prompts(tokenizer, rows, data)
    step = batch_size or max(len(rows), 1)
    out: list[str] = []
    for start in range(0, len(rows), step):
        rollout = engine.generate(
            prompt_ids[start : start + step],
            group_size=n,
            max_new_tokens=max_new_tokens,
            greedy=greedy,
            temperature=1.0 if greedy else temperature,
            top_p=1.0,
            top_k=0,
            generator_seed=None if greedy else seed * 1_000_003 + start,
        )
        _check_finite_logits(rollout)
        out += decode_completions(tokenizer, rollout)
    return out


def _check_finite_logits(rollout) -> None:
    """A greedy completion picked from NaN logits is an arbitrary token (sampling from them fails
    in the engine): an evaluation of such completions would report a score of a model that
    produced nothing.

    Raises:
        EvaluationFailed: a generated token's log-probability is NaN.
    """
    logprobs = getattr(rollout, "sampler_logprobs", None)
    if logprobs is None:
        return
    generated = rollout.response_mask.bool()
    bad = int(torch.isnan(logprobs[generated]).sum())
    if bad:
        raise EvaluationFailed(
            f"the model's logits were not finite: {bad} of {int(generated.sum())} generated tokens have a "
            "NaN log-probability (its weights or activations overflow), so nothing was evaluated; evaluate a "
            "checkpoint from before it diverged or repair the model"
        )


def score_completions(reward_fn: RewardFn, rows, completions: list[str], repeat: int) -> list[float]:
    """``reward_fn``'s score of each completion, ``repeat`` contiguous completions per row."""
    prompts = [r["prompt"] for r in rows for _ in range(repeat)]
    return [float(x) for x in reward_fn(prompts, completions, **row_fields_from_rows(rows, repeat=repeat))]


@torch.inference_mode()
def greedy_eval(
    engine,
    tokenizer,
    rows: list[dict[str, Any]],
    *,
    data,
    max_new_tokens: int,
    batch_size: int | None = None,
    reward_fn: RewardFn | None = None,
) -> list[dict[str, Any]]:
    """Greedy completions of held-out rows, scored by ``reward_fn`` (default: answer correctness).

    Args:
        engine: a rollout engine (``generate(..., greedy=True)``).
        tokenizer: the policy's tokenizer.
        rows: dataset rows with ``prompt`` (and the fields ``reward_fn`` reads, ``answer``).
        data: the data section (prompt formatting: system prompt, chat template, prompt length).
        max_new_tokens: the most tokens per completion.
        batch_size: prompts per ``generate`` call (None: all in one).

    Returns:
        one record per row: ``{"prompt", "answer", "completion", "reward"}``; the accuracy is the
        fraction of rewards > 0.5.
    """
    reward_fn = reward_fn or answer_correctness
    completions = sample_completions(
        engine, tokenizer, rows, data=data, n=1, greedy=True, temperature=1.0,
        max_new_tokens=max_new_tokens, batch_size=batch_size, seed=0,
    )
    rewards = score_completions(reward_fn, rows, completions, 1) if rows else []
    return [
        {"prompt": row["prompt"], "answer": row.get("answer"), "completion": c, "reward": r}
        for row, c, r in zip(rows, completions, rewards)
    ]


@torch.inference_mode()
def evaluate(
    engine,
    tokenizer,
    rows: list[dict[str, Any]],
    *,
    data,
    max_new_tokens: int,
    samples: int = 0,
    ks: Sequence[int] = (),
    temperature: float = 1.0,
    batch_size: int | None = None,
    seed: int = 0,
    reward_fn: RewardFn | None = None,
    answer_fn: AnswerFn | None = extract_answer,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy accuracy and, with ``samples`` = n >= 2, pass@k and maj@k for each k in ``ks``.

    Args:
        engine, tokenizer, rows, data, max_new_tokens, batch_size: as :func:`greedy_eval`.
        samples: n sampled completions per row at ``temperature`` (0 or 1: greedy only).
        ks: the k of pass@k / maj@k, each in 1 .. n (default [1, n]).
        seed: the sampling seed (per ``generate`` call, so the global RNG is untouched).
        reward_fn, answer_fn: the hooks of the module docstring.

    Returns:
        ``(metrics, records)``: metrics ``accuracy``, ``pass@k`` and ``maj@k`` (floats in [0, 1]);
        one record per row (:func:`greedy_eval`'s, plus ``samples``: each sample's completion,
        reward and answer).

    Raises:
        ValueError: a k outside 1 .. n.
    """
    reward_fn = reward_fn or answer_correctness
    records = greedy_eval(
        engine, tokenizer, rows, data=data, max_new_tokens=max_new_tokens, batch_size=batch_size,
        reward_fn=reward_fn,
    )
    metrics = {"accuracy": sum(r["reward"] > 0.5 for r in records) / max(len(records), 1)}
    if samples < 2 or not rows:
        return metrics, records
    ks = sorted(set(ks)) if ks else [1, samples]
    for k in ks:
        if not 1 <= k <= samples:
            raise ValueError(f"--k {k}: each k must be in 1 .. --samples {samples}")
    texts = sample_completions(
        engine, tokenizer, rows, data=data, n=samples, greedy=False, temperature=temperature,
        max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
    )
    rewards = score_completions(reward_fn, rows, texts, samples)
    sums = dict.fromkeys([f"pass@{k}" for k in ks] + ([f"maj@{k}" for k in ks] if answer_fn else []), 0.0)
    for i, rec in enumerate(records):
        mine = slice(i * samples, (i + 1) * samples)
        correct = [x > 0.5 for x in rewards[mine]]
        answers = [answer_fn(t) for t in texts[mine]] if answer_fn else [None] * samples
        for k in ks:
            sums[f"pass@{k}"] += pass_at_k(samples, sum(correct), k)
            if answer_fn:
                sums[f"maj@{k}"] += majority_at_k(answers, correct, k)
        rec["samples"] = [
            {"completion": t, "reward": x, "answer": a}
            for t, x, a in zip(texts[mine], rewards[mine], answers)
        ]
    metrics.update({name: total / len(records) for name, total in sums.items()})
    return metrics, records


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
    model: str,
    data,
    *,
    limit: int,
    samples: int = 1,
    ks: Sequence[int] = (),
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int | None = None,
    output: str | None = None,
    seed: int = 0,
    engine: str = "auto",
    adapter: str | None = None,
    rollout: dict[str, Any] | None = None,
    reward_fn: RewardFn | None = None,
    answer_fn: AnswerFn | None = extract_answer,
) -> dict[str, Any]:
    """``policygrad eval``: :func:`evaluate` on the first ``limit`` rows of ``data.eval_dataset``
    (all of them when it has fewer), with the rollout engine built as a training run builds it.

    Args:
        model: ``model.name`` (a full model or a LoRA adapter folder, see
            :mod:`policygrad.models.adapters`); ``adapter``: ``model.adapter``.
        data: a :class:`~policygrad.config.train.DataConfig` (``eval_dataset``, its split and
            field mapping).
        engine: ``auto`` (vLLM when installed), ``hf`` or ``vllm``; ``rollout``: other
            ``rollout.*`` fields (e.g. ``vllm_kv_cache_gb``).
        samples, ks, temperature, batch_size, seed, reward_fn, answer_fn: as :func:`evaluate`.
        output: JSONL of every completion and its reward (default ``eval-<dataset>.jsonl``).

    Returns:
        ``{"model", "dataset", "engine", "n", "accuracy", "pass@k"..., "maj@k"..., "output",
        "seconds" (generation and scoring), "load_seconds" (model and engine)}``.

    Raises:
        ConfigError: a bad engine or rollout field. ValueError / OSError / FileNotFoundError:
            a bad model, adapter or dataset, named.
    """
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    output = eval_output_path(output, data.eval_dataset)
    cfg = TrainConfig(
        seed=seed,
        model=ModelConfig(name=model, adapter=adapter),
        data=data,
        rollout=RolloutConfig(engine=engine, max_new_tokens=max_new_tokens, **(rollout or {})),
        reward=RewardConfig(functions=list(TaskReward.functions)),  # what judges rows of any kind
    )
    with eval_engine(cfg, limit) as (rows, models, gen, name, load_seconds):
        t0 = time.perf_counter()
        metrics, records = evaluate(
            gen, models.tokenizer, rows, data=data, max_new_tokens=max_new_tokens,
            samples=samples, ks=ks, temperature=temperature, batch_size=batch_size, seed=seed,
            reward_fn=reward_fn, answer_fn=answer_fn,
        )
        seconds = time.perf_counter() - t0
    write_jsonl(output, records)
    return {
        "model": model,
        "dataset": data.eval_dataset,
        "engine": name,
        "n": len(records),
        **metrics,
        "output": output,
        "seconds": round(seconds, 1),
        "load_seconds": round(load_seconds, 1),
    }


# ---------------------------------------------------------------------------------- episodes

# The dataset ``policygrad eval --env`` evaluates on when no --dataset is given (held-out split).
