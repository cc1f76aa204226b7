"""Evaluation: greedy accuracy of a policy on held-out rows (used by the trainer and by
``policygrad eval``), and pass@k from sampled answers."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch

from policygrad.data.chat import encode_prompts
from policygrad.rewards.verifiers import answer_correctness

__all__ = ["decode_completions", "evaluate_model", "greedy_eval", "pass_at_k", "write_jsonl"]


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


def decode_completions(tokenizer, rollout) -> list[str]:
    """Completion strings of a rollout: valid response tokens only, special tokens dropped."""
    ids = rollout.response_ids.masked_fill(rollout.response_mask == 0, tokenizer.pad_token_id)
    return tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)


def write_jsonl(path: str, records: list[dict[str, Any]]) -> None:
    """One JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


@torch.inference_mode()
def greedy_eval(
    engine, tokenizer, rows: list[dict[str, Any]], *, data, max_new_tokens: int, batch_size: int = 64
) -> list[dict[str, Any]]:
    """Greedy completions of held-out rows, judged by the answer-correctness verifier.

    Args:
        engine: a rollout engine (``generate(..., greedy=True)``).
        tokenizer: the policy's tokenizer.
        rows: dataset rows with ``prompt`` and ``answer``.
        data: the data section (prompt formatting: system prompt, chat template, prompt length).
        max_new_tokens: the most tokens per completion.
        batch_size: prompts per ``generate`` call.

    Returns:
        one record per row: ``{"prompt", "answer", "completion", "reward"}`` (reward 1.0 or 0.0);
        the accuracy is the mean reward.
    """
    records = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        rollout = engine.generate(
            encode_prompts(tokenizer, chunk, data),
            group_size=1,
            max_new_tokens=max_new_tokens,
            greedy=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
        )
        completions = decode_completions(tokenizer, rollout)
        rewards = answer_correctness(
            [r["prompt"] for r in chunk], completions, answer=[r["answer"] for r in chunk]
        )
        for row, completion, reward in zip(chunk, completions, rewards):
            records.append(
                {
                    "prompt": row["prompt"],
                    "answer": row["answer"],
                    "completion": completion,
                    "reward": float(reward),
                }
            )
    return records


def evaluate_model(
    model: str,
    data,
    *,
    limit: int,
    samples: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    output: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Greedy accuracy (answer-correctness verifier) on the first ``limit`` items of
    ``data.eval_dataset`` (all of them when it has fewer) and, with ``samples`` = k > 1, pass@k
    from k samples at ``temperature``. Every completion and its reward go to a JSONL file.

    Returns a dict with ``accuracy``, ``pass@k`` (when k > 1), ``n``, ``output`` and timings.
    """
    from policygrad.data.sources import build_eval_rows
    from policygrad.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model_path
    from policygrad.rollout.hf import HFRolloutEngine

    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    rows = build_eval_rows(data, seed=seed, at_most=True)[:limit]
    path = resolve_model_path(model)
    tokenizer = load_tokenizer(path)
    policy = load_causal_lm(path, dtype="float32", trainable=False)
    engine = HFRolloutEngine(policy, tokenizer, eos_token_ids(tokenizer, policy))
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    records = greedy_eval(
        engine, tokenizer, rows, data=data, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    pass_values = []
    if samples > 1:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            sampled = engine.generate(
                encode_prompts(tokenizer, chunk, data),
                group_size=samples,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
            )
            texts = decode_completions(tokenizer, sampled)
            rewards = answer_correctness(
                [r["prompt"] for r in chunk for _ in range(samples)],
                texts,
                answer=[r["answer"] for r in chunk for _ in range(samples)],
            )
            for i, rec in enumerate(records[start : start + len(chunk)]):
                mine = [float(x) for x in rewards[i * samples : (i + 1) * samples]]
                pass_values.append(pass_at_k(samples, sum(1 for x in mine if x > 0.5), samples))
                rec["samples"] = [
                    {"completion": t, "reward": x}
                    for t, x in zip(texts[i * samples : (i + 1) * samples], mine)
                ]
    if output is None:
        stem = os.path.splitext(os.path.basename(data.eval_dataset or "builtin"))[0].replace(":", "-")
        output = f"eval-{stem}.jsonl"
    write_jsonl(output, records)
    result: dict[str, Any] = {
        "model": model,
        "dataset": data.eval_dataset,
        "n": len(records),
        "accuracy": sum(1 for r in records if r["reward"] > 0.5) / max(len(records), 1),
        "output": output,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if samples > 1:
        result[f"pass@{samples}"] = sum(pass_values) / len(pass_values)
    return result
