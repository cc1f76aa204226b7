"""``policygrad eval``: greedy accuracy and pass@k of a model on a prompt dataset."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch


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
    from policygrad.data.chat import format_prompt, tokenize_prompts
    from policygrad.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model_path
    from policygrad.rewards.verifiers import answer_correctness
    from policygrad.rollout.hf import HFRolloutEngine
    from policygrad.trainer.sources import build_eval_rows

    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    rows = build_eval_rows(data, seed=seed, at_most=True)[:limit]
    path = resolve_model_path(model)
    tokenizer = load_tokenizer(path)
    policy = load_causal_lm(path, dtype="float32", trainable=False)
    engine = HFRolloutEngine(policy, tokenizer, eos_token_ids(tokenizer, policy))
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    n_correct_greedy = 0
    pass_values = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        texts = [
            format_prompt(
                tokenizer,
                r["prompt"],
                system_prompt=data.system_prompt,
                use_chat_template=data.use_chat_template,
            )
            for r in chunk
        ]
        ids = tokenize_prompts(tokenizer, texts, max_prompt_length=data.max_prompt_length)
        greedy = engine.generate(
            ids, group_size=1, max_new_tokens=max_new_tokens, greedy=True, temperature=1.0, top_p=1.0, top_k=0
        )
        completions = decode_completions(tokenizer, greedy)
        answers = [r["answer"] for r in chunk]
        rewards = answer_correctness([r["prompt"] for r in chunk], completions, answer=answers)
        sampled_rewards: list[list[float]] = [[] for _ in chunk]
        sampled_text: list[list[str]] = [[] for _ in chunk]
        if samples > 1:
            sampled = engine.generate(
                ids,
                group_size=samples,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
            )
            texts_k = decode_completions(tokenizer, sampled)
            rep_answers = [a for a in answers for _ in range(samples)]
            rep_prompts = [r["prompt"] for r in chunk for _ in range(samples)]
            rk = answer_correctness(rep_prompts, texts_k, answer=rep_answers)
            for j in range(len(texts_k)):
                sampled_rewards[j // samples].append(float(rk[j]))
                sampled_text[j // samples].append(texts_k[j])
        for i, row in enumerate(chunk):
            n_correct_greedy += int(rewards[i] > 0.5)
            rec = {
                "prompt": row["prompt"],
                "answer": row["answer"],
                "completion": completions[i],
                "reward": float(rewards[i]),
            }
            if samples > 1:
                c = sum(1 for x in sampled_rewards[i] if x > 0.5)
                pass_values.append(pass_at_k(samples, c, samples))
                rec["samples"] = [
                    {"completion": t, "reward": x} for t, x in zip(sampled_text[i], sampled_rewards[i])
                ]
            records.append(rec)
    if output is None:
        stem = os.path.splitext(os.path.basename(data.eval_dataset or "builtin"))[0].replace(":", "-")
        output = f"eval-{stem}.jsonl"
    with open(output, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    result: dict[str, Any] = {
        "model": model,
        "dataset": data.eval_dataset,
        "n": len(records),
        "accuracy": n_correct_greedy / max(len(records), 1),
        "output": output,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if samples > 1:
        result[f"pass@{samples}"] = sum(pass_values) / len(pass_values)
    return result


def decode_completions(tokenizer, rollout) -> list[str]:
    """Completion strings of a rollout: valid response tokens only, special tokens dropped."""
    ids = rollout.response_ids.masked_fill(rollout.response_mask == 0, tokenizer.pad_token_id)
    return tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)
