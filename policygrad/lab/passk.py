"""Does RL teach or select? pass@k of a base and a trained model on the same problems
(``policygrad lab passk``).

Yue et al. 2025 ("Does Reinforcement Learning Really Incentivize Reasoning Capacity in LLMs
Beyond the Base Model?") compare a base model and its RL-trained version by pass@k over a wide
range of k: RL raises pass@1, but at large k the base model often catches up or overtakes, as if
RL sharpened the distribution towards answers the base could already sample (selection) rather
than reaching new ones (teaching). This command measures that curve on a small scale:

- both models answer the same held-out rows (those ``policygrad eval`` picks for the dataset,
  default the built-in arithmetic task's held-out split), each with one greedy completion and n
  sampled ones, through the engine and generation code of ``policygrad eval``
  (:mod:`policygrad.evaluate.evaluation`), one model after the other;
- pass@k for k = 1, 2, 4, ..., n (and n itself) with the unbiased estimator of Chen et al. 2021
  (:func:`~policygrad.evaluate.scoring.pass_at_k`), averaged over the rows;
- coverage: the rows each model solves at least once in n samples, and those only one of them
  solves.

It prints a table and writes ``passk.json``, ``passk.png`` (pass@k against k on a log2 axis) and
``passk.html`` (the plot and the tables) under ``--output-dir``; every file is written whole or
not at all, and only after both models are measured.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

from policygrad.arguments import OneLineArgumentParser, check_temperature
from policygrad.lab.common import (
    DEFAULT_OUTPUT_DIR,
    check_output_dir,
    set_threads,
)
from policygrad.lab.passk_curve import parse_ks, pass_at_k_curve
from policygrad.lab.passk_report import (
    ModelPassK,
    PassKResult,
    passk_table,
    write_outputs,
)

DEFAULT_DATASET = "builtin:arithmetic"


def measure(
    engine,
    tokenizer,
    rows: list[dict[str, Any]],
    *,
    data,
    samples: int,
    ks: Sequence[int],
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int | None = None,
    seed: int = 0,
    reward_fn: Callable[..., Sequence[float]] | None = None,
    label: str = "model",
    model: str = "",
    engine_name: str = "",
) -> ModelPassK:
    """Greedy correctness and n sampled completions per row, scored, with ``policygrad eval``'s
    generation and scoring (:func:`~policygrad.evaluate.evaluation.greedy_eval` and the same
    sampling call as :func:`~policygrad.evaluate.evaluation.evaluate`, so a seed gives the samples
    ``policygrad eval --samples n`` draws).

    Args:
        engine: a rollout engine; tokenizer: the model's.
        rows: held-out rows (``prompt``, ``answer`` or the fields ``reward_fn`` reads).
        data: the data section (chat template, system prompt, prompt length).
        samples: n >= 1 samples per row at ``temperature``; ks: each in 1 .. n.
        reward_fn: ``(prompts, completions, **row_fields) -> rewards`` (> 0.5 is correct;
            default: answer correctness).

    Returns:
        :class:`ModelPassK` (``seconds`` measured here; ``load_seconds`` left 0).

    Raises:
        ValueError: samples < 1 or a k outside 1 .. n.
    """
    # The sampling helpers of policygrad eval, so both commands draw the same completions.
    from policygrad.evaluate.evaluation import greedy_eval, sample_completions
    from policygrad.evaluate.scoring import score_completions
    from policygrad.rewards.verifiers import answer_correctness

    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    parse_ks(",".join(map(str, ks)), samples)  # checks each k
    reward_fn = reward_fn or answer_correctness
    t0 = time.perf_counter()
    greedy = greedy_eval(
        engine,
        tokenizer,
        rows,
        data=data,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        reward_fn=reward_fn,
    )
    texts = (
        sample_completions(
            engine,
            tokenizer,
            rows,
            data=data,
            n=samples,
            greedy=False,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            seed=seed,
        )
        if rows
        else []
    )
    rewards = score_completions(reward_fn, rows, texts, samples) if rows else []
    correct = [sum(r > 0.5 for r in rewards[i * samples : (i + 1) * samples]) for i in range(len(rows))]
    greedy_correct = [rec["reward"] > 0.5 for rec in greedy]
    return ModelPassK(
        label=label,
        model=model,
        engine=engine_name,
        greedy_correct=greedy_correct,
        correct=correct,
        pass_at_k=pass_at_k_curve(correct, samples, ks),
        greedy_accuracy=sum(greedy_correct) / max(len(greedy_correct), 1),
        seconds=time.perf_counter() - t0,
    )


def check_model(spec: str, flag: str) -> None:
    """Resolve a model argument as ``policygrad eval --model`` does (a bundled model is converted
    on first use), so a wrong one fails before any model loads.

    Raises:
        ValueError: the spec's error, prefixed with ``flag``.
    """
    # imported here: models and their adapters load only once a model is checked
    from policygrad.models.adapters import resolve_model_source

    try:
        resolve_model_source(spec)
    except (ValueError, TypeError, FileNotFoundError) as e:
        text = str(e).strip()
        for prefix in ("model: ", "model "):
            if text.startswith(prefix):
                text = text[len(prefix) :]
        raise ValueError(f"{flag} {spec}: {text}") from None


def run_passk(
    base: str,
    trained: str,
    *,
    data=None,
    limit: int = 50,
    samples: int = 32,
    ks: Sequence[int] | None = None,
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    batch_size: int | None = None,
    engine: str = "auto",
    seed: int = 0,
    output_dir: str | None = DEFAULT_OUTPUT_DIR,
) -> PassKResult:
    """Measure pass@k of ``base`` and ``trained`` on the same held-out rows (module docstring).

    Args:
        base, trained: anything ``policygrad eval --model`` takes (``bundled:NAME``, a model
            folder, a run's ``checkpoints/step_N/model`` (full or LoRA adapter), a cached hub id).
        data: a :class:`~policygrad.config.train.DataConfig` with ``eval_dataset`` set
            (default: the built-in arithmetic task's held-out split, ``limit`` rows).
        limit: the first ``limit`` held-out rows (all when fewer); samples: n per row;
        ks: the k of the curve (default :func:`k_ladder`), each in 1 .. n.
        temperature, max_new_tokens, batch_size, engine, seed: as ``policygrad eval``; both
            models draw with the same seed.
        output_dir: folder of ``passk.json`` / ``.png`` / ``.html``; None writes nothing.

    Returns:
        :class:`PassKResult`.

    Raises:
        ValueError: limit or samples < 1, a k outside 1 .. n, a bad model spec (named by
            ``--base`` / ``--trained``); ConfigError / OSError: a bad engine or dataset.
    """
    # imported here: the trainer's config, evaluation and rewards load only for a measurement
    from policygrad.config.train import DataConfig, ModelConfig, RewardConfig, RolloutConfig, TrainConfig
    from policygrad.evaluate.model import eval_engine
    from policygrad.rewards.code import TaskReward

    if limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    ks = parse_ks(",".join(map(str, ks)) if ks else None, samples)
    check_temperature(temperature)
    if output_dir is not None:
        check_output_dir(output_dir)
    if data is None:
        data = DataConfig(dataset=DEFAULT_DATASET, eval_dataset=DEFAULT_DATASET, eval_size=limit)
    check_model(base, "--base")
    check_model(trained, "--trained")
    reward_fn = TaskReward()  # answer correctness, or the sandboxed tests of code rows
    measured: list[ModelPassK] = []
    problems: list[dict[str, Any]] = []
    for label, spec in (("base", base), ("trained", trained)):
        # The configuration policygrad eval builds, so the engine and rows are the same.
        cfg = TrainConfig(
            seed=seed,
            model=ModelConfig(name=spec),
            data=data,
            rollout=RolloutConfig(engine=engine, max_new_tokens=max_new_tokens),
            reward=RewardConfig(functions=list(TaskReward.functions)),
        )
        with eval_engine(cfg, limit) as (rows, models, gen, name, load_seconds):
            if not rows:
                raise ValueError(f"{data.eval_dataset} has no held-out rows to evaluate")
            here = [{"prompt": r["prompt"], "answer": r.get("answer")} for r in rows]
            if problems and here != problems:  # same data and seed: a mismatch is a bug
                raise RuntimeError("the two models were given different held-out rows")
            problems = here
            m = measure(
                gen,
                models.tokenizer,
                rows,
                data=data,
                samples=samples,
                ks=ks,
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                batch_size=batch_size,
                seed=seed,
                reward_fn=reward_fn,
                label=label,
                model=spec,
                engine_name=name,
            )
            m.load_seconds = load_seconds
        measured.append(m)
    result = PassKResult(
        models=measured,
        problems=problems,
        ks=list(ks),
        settings={
            "dataset": data.eval_dataset,
            "problems": len(problems),
            "samples": samples,
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "engine": engine,
            "seed": seed,
        },
    )
    result.table = passk_table(result)
    if output_dir is not None:
        write_outputs(result, output_dir)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="policygrad lab passk",
        description="pass@k for k = 1, 2, 4, ..., n of a base and a trained model on the same held-out "
        "problems: does RL teach new solutions or select ones the base could already sample? "
        "(Yue et al. 2025)",
    )
    model_help = "model folder, a run's checkpoints/step_N/model, hub id or bundled:NAME (as policygrad eval)"
    p.add_argument("--base", required=True, help=f"the model before RL: {model_help}")
    p.add_argument("--trained", required=True, help=f"the model after RL: {model_help}")
    p.add_argument(
        "--dataset",
        default=DEFAULT_DATASET,
        help="as policygrad eval: JSONL path, Hub dataset id, builtin:arithmetic (held-out split), ... "
        f"(default {DEFAULT_DATASET})",
    )
    p.add_argument("--dataset-config", default=None, help="the Hub dataset's config (openai/gsm8k: main)")
    p.add_argument("--split", default=None, help="split of a Hub dataset or dataset folder (default test)")
    p.add_argument("--difficulty", default="medium", help="difficulty of builtin:arithmetic / builtin:code")
    p.add_argument("--prompt-field", default=None)
    p.add_argument("--answer-field", default=None)
    p.add_argument("--limit", type=int, default=50, help="first N held-out problems (default 50)")
    p.add_argument("--samples", type=int, default=32, help="n samples per problem per model (default 32)")
    p.add_argument("--k", default=None, help="comma-separated k <= n (default 1,2,4,...,n)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--engine", default="auto", choices=("auto", "hf", "vllm"), help="auto: vllm when installed"
    )
    p.add_argument("--batch-size", type=int, default=None, help="prompts per generate call (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        "--num-threads",
        dest="threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's)",
    )
    p.add_argument("--output-dir", "--out", dest="output_dir", default=DEFAULT_OUTPUT_DIR)
    return p


def main(argv: list[str]) -> str:
    """``policygrad lab passk --base M --trained M ...``: every flag is checked before a model
    loads."""
    # imported here: every flag is checked before the config and rewards load
    from policygrad.config.train import RewardConfig, TrainConfig
    from policygrad.evaluate.command import eval_data_config  # the rows policygrad eval picks for these flags
    from policygrad.rewards.code import TaskReward

    args = build_parser().parse_args(argv)
    for flag, value in (
        ("--limit", args.limit),
        ("--samples", args.samples),
        ("--max-new-tokens", args.max_new_tokens),
        ("--batch-size", args.batch_size),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    ks = parse_ks(args.k, args.samples)
    set_threads(args.threads)
    check_temperature(args.temperature)
    output_dir = check_output_dir(args.output_dir)
    data = eval_data_config(args, args.dataset)
    TrainConfig(data=data, reward=RewardConfig(functions=list(TaskReward.functions)))  # validates
    t0 = time.perf_counter()
    result = run_passk(
        args.base,
        args.trained,
        data=data,
        limit=args.limit,
        samples=args.samples,
        ks=ks,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        engine=args.engine,
        seed=args.seed,
        output_dir=output_dir,
    )
    return "\n".join(
        [
            result.table,
            f"\n{time.perf_counter() - t0:.0f} s in all",
            f"wrote {result.json_path}\nwrote {result.png_path}\nwrote {result.html_path}",
        ]
    )
