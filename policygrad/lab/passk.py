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
import base64
import dataclasses
import html
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from policygrad.lab.common import (
    DEFAULT_OUTPUT_DIR,
    OneLineArgumentParser,
    check_output_dir,
    check_temperature,
    ensure_output_dir,
    format_table,
    plain,
    pyplot,
    save_figure,
    set_threads,
)

DEFAULT_DATASET = "builtin:arithmetic"


def k_ladder(n: int) -> list[int]:
    """The k of the curve for n samples: the powers of two up to n, and n itself when it is not
    one (``k_ladder(32) == [1, 2, 4, 8, 16, 32]``, ``k_ladder(6) == [1, 2, 4, 6]``).

    Raises:
        ValueError: n < 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--samples must be an integer >= 1, got {n!r}")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def parse_ks(text: str | None, n: int) -> list[int]:
    """``--k``: comma-separated k (sorted, duplicates dropped), each in 1 .. n; None or empty:
    :func:`k_ladder`.

    Raises:
        ValueError: an item that is not an integer, or a k outside 1 .. n (names ``--k`` and
            ``--samples``).
    """
    if not text or not text.strip():
        return k_ladder(n)
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise ValueError(f"--k {text!r} must be comma-separated integers, e.g. --k 1,4,16") from None
    if not ks:
        raise ValueError(f"--k {text!r} names no k; give comma-separated integers, e.g. --k 1,4,16")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(
            f"--k {text}: each k must be in 1 .. --samples {n} (pass@k needs at least k samples per "
            f"problem); drop {', '.join(map(str, bad))} or raise --samples"
        )
    return ks


def pass_at_k_curve(correct: Sequence[int], n: int, ks: Sequence[int]) -> dict[int, float]:
    """Mean over problems of the unbiased pass@k (Chen et al. 2021, eq. 1), for each k.

    Args:
        correct: per problem, how many of its n samples are correct (ints in 0 .. n).
        n: samples per problem.
        ks: the k, each in 1 .. n.

    Returns:
        ``{k: pass@k}``, floats in [0, 1] (0.0 for every k when there is no problem).

    Raises:
        ValueError: a count outside 0 .. n or a k outside 1 .. n (from
            :func:`~policygrad.evaluate.scoring.pass_at_k`; k < 1 named here).
    """
    from policygrad.evaluate.scoring import pass_at_k  # imported here: it loads torch

    out = {}
    for k in ks:
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        out[k] = sum(pass_at_k(n, c, k) for c in correct) / len(correct) if correct else 0.0
    return out


@dataclasses.dataclass
class ModelPassK:
    """One model's measurement.

    Fields:
        label: ``base`` or ``trained``; model: the model spec as given; engine: the engine used.
        greedy_correct: per problem, whether the greedy completion is correct.
        correct: per problem, how many of the n samples are correct.
        pass_at_k: ``{k: pass@k}``; greedy_accuracy: the fraction of greedy completions correct.
        seconds: generation and scoring; load_seconds: model and engine.
    """

    label: str
    model: str
    engine: str
    greedy_correct: list[bool]
    correct: list[int]
    pass_at_k: dict[int, float]
    greedy_accuracy: float
    seconds: float = 0.0
    load_seconds: float = 0.0

    @property
    def solved(self) -> int:
        """Problems with at least one correct sample (n * pass@n)."""
        return sum(c > 0 for c in self.correct)


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
        engine, tokenizer, rows, data=data, max_new_tokens=max_new_tokens, batch_size=batch_size,
        reward_fn=reward_fn,
    )
    texts = sample_completions(
        engine, tokenizer, rows, data=data, n=samples, greedy=False, temperature=temperature,
        max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
    ) if rows else []
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


@dataclasses.dataclass
class PassKResult:
    """Everything ``policygrad lab passk`` measured.

    Fields:
        models: ``[base, trained]`` :class:`ModelPassK`.
        problems: per row ``{"prompt", "answer"}`` (the same rows for both models).
        ks: the k of the curve; settings: the run's settings.
        table: the printed text; json_path, png_path, html_path: files written (or None).
    """

    models: list[ModelPassK]
    problems: list[dict[str, Any]]
    ks: list[int]
    settings: dict[str, Any]
    table: str = ""
    json_path: str | None = None
    png_path: str | None = None
    html_path: str | None = None

    def coverage(self) -> dict[str, int]:
        """Rows solved (at least one correct sample) by each model, by both, by only one."""
        base, trained = (m.correct for m in self.models)
        return {
            "problems": len(base),
            "solved_by_base": sum(c > 0 for c in base),
            "solved_by_trained": sum(c > 0 for c in trained),
            "solved_by_both": sum(b > 0 and t > 0 for b, t in zip(base, trained)),
            "only_base": sum(b > 0 and t == 0 for b, t in zip(base, trained)),
            "only_trained": sum(t > 0 and b == 0 for b, t in zip(base, trained)),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, ks, coverage, and per model its pass@k (keys ``"1"``, ``"2"``...),
        greedy accuracy, timings and per-problem correct counts; the problems' prompts and answers."""
        models = {}
        for m in self.models:
            models[m.label] = {
                "model": m.model,
                "engine": m.engine,
                "greedy_accuracy": m.greedy_accuracy,
                "pass_at_k": {str(k): v for k, v in m.pass_at_k.items()},
                "correct": m.correct,
                "greedy_correct": m.greedy_correct,
                "seconds": round(m.seconds, 1),
                "load_seconds": round(m.load_seconds, 1),
            }
        return {
            "settings": self.settings,
            "ks": self.ks,
            "coverage": self.coverage(),
            "models": models,
            "problems": self.problems,
        }


def passk_table(result: PassKResult) -> str:
    """pass@k per k for both models and their difference, then greedy accuracy and coverage."""
    base, trained = result.models
    n = result.settings["samples"]
    rows = [[f"pass@{k}", base.pass_at_k[k], trained.pass_at_k[k], trained.pass_at_k[k] - base.pass_at_k[k]]
            for k in result.ks]
    rows.append(["greedy", base.greedy_accuracy, trained.greedy_accuracy,
                 trained.greedy_accuracy - base.greedy_accuracy])
    cov = result.coverage()
    head = (
        f"{cov['problems']} problems of {result.settings['dataset']}, n={n} samples each at temperature "
        f"{result.settings['temperature']:g} (unbiased pass@k, Chen et al. 2021)"
    )
    lines = [head, format_table(["metric", "base", "trained", "trained - base"], rows, digits=3), ""]
    lines.append(
        f"solved at least once in {n} samples: base {cov['solved_by_base']}, "
        f"trained {cov['solved_by_trained']}, "
        f"both {cov['solved_by_both']}; only base {cov['only_base']}, only trained {cov['only_trained']}"
    )
    for m in (base, trained):
        lines.append(
            f"{m.label + ':':8} {m.model} ({m.engine}, {m.seconds:.0f} s generating and scoring, "
            f"{m.load_seconds:.0f} s loading)"
        )
    return "\n".join(lines)


_COLORS = {"base": "#1f77b4", "trained": "#d62728"}


def plot_passk(result: PassKResult, path: str) -> str:
    """pass@k against k (log2 x axis), one line per model; greedy accuracy as a dotted line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for m, style in zip(result.models, ("o-", "s--")):  # two styles: equal curves stay visible
        color = _COLORS.get(m.label)
        ys = [m.pass_at_k[k] for k in result.ks]
        ax.plot(result.ks, ys, style, color=color, label=f"{m.label}: {m.model}", ms=5)
        ax.axhline(m.greedy_accuracy, ls=":", lw=1, color=color, label=f"{m.label} greedy")
    ax.set_xscale("log", base=2)
    ax.set_xticks(result.ks)
    ax.set_xticklabels([str(k) for k in result.ks])
    ax.minorticks_off()
    ax.set_ylim(-0.02, 1.02)
    ax.set(xlabel="k (samples drawn)", ylabel="pass@k", title=f"pass@k on {result.settings['dataset']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # off the curves
    fig.tight_layout()
    return save_figure(fig, path)


def render_html(result: PassKResult, png: bytes) -> str:
    """A self-contained page: the settings, the plot (embedded PNG), the pass@k table, coverage
    and the per-problem correct counts."""
    from policygrad.lab.report import REPORT_CSS  # the look of policygrad report

    esc = html.escape
    base, trained = result.models
    n = result.settings["samples"]

    def cell(v: float) -> str:
        return f"{v:.3f}"

    head = "<tr><th>k</th><th>base</th><th>trained</th><th>trained - base</th></tr>"
    body = "".join(
        f"<tr><td>pass@{k}</td><td>{cell(base.pass_at_k[k])}</td><td>{cell(trained.pass_at_k[k])}</td>"
        f"<td>{trained.pass_at_k[k] - base.pass_at_k[k]:+.3f}</td></tr>"
        for k in result.ks
    )
    body += (
        f"<tr><td>greedy</td><td>{cell(base.greedy_accuracy)}</td><td>{cell(trained.greedy_accuracy)}</td>"
        f"<td>{trained.greedy_accuracy - base.greedy_accuracy:+.3f}</td></tr>"
    )
    cov = result.coverage()
    per_problem = "".join(
        f"<tr><td>{esc(str(p.get('prompt', '')))}</td><td>{esc(str(p.get('answer', '')))}</td>"
        f"<td>{b}/{n}</td><td>{t}/{n}</td></tr>"
        for p, b, t in zip(result.problems, base.correct, trained.correct)
    )
    settings = "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(str(v))}</td></tr>" for k, v in result.settings.items()
    )
    img = base64.b64encode(png).decode("ascii")
    caption = "pass@k against k (log2 axis); dotted: greedy accuracy"
    return "\n".join([
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>policygrad lab passk</title><style>{REPORT_CSS}</style></head><body>",
        "<h1>pass@k: base vs trained</h1>",
        "<p>" + "<br>".join(
            f"{m.label}: <code>{esc(m.model)}</code> ({esc(m.engine)}, {m.seconds:.0f} s generating and "
            f"scoring, {m.load_seconds:.0f} s loading)" for m in (base, trained)
        ) + "</p>",
        "<p class='muted'>Unbiased pass@k (Chen et al. 2021) from n samples per problem. A trained model "
        "above the base at k = 1 but level with or below it at large k is consistent with RL selecting "
        "answers the base could already sample (Yue et al. 2025).</p>",
        f'<figure><img src="data:image/png;base64,{img}" alt="{esc(caption)}">'
        f"<figcaption>{esc(caption)}</figcaption></figure>",
        f"<h2>pass@k</h2><table>{head}{body}</table>",
        f"<h2>Coverage</h2><p>solved at least once in {n} samples: base {cov['solved_by_base']}, trained "
        f"{cov['solved_by_trained']}, both {cov['solved_by_both']}; only base {cov['only_base']}, "
        f"only trained {cov['only_trained']} (of {cov['problems']})</p>",
        "<h2>Problems</h2><table><tr><th>prompt</th><th>answer</th><th>base correct</th>"
        f"<th>trained correct</th></tr>{per_problem}</table>",
        f"<h2>Settings</h2><table>{settings}</table>",
        "</body></html>",
    ])


def _atomic_write(path: str, data: bytes) -> str:
    """Write ``data`` to a temporary file beside ``path`` and rename it over ``path``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def write_outputs(result: PassKResult, output_dir: str) -> PassKResult:
    """``passk.png``, ``passk.html`` and ``passk.json`` under ``output_dir`` (created), each
    written whole (temporary file, then rename); the JSON last. Sets the paths on ``result``.

    Raises:
        ValueError: ``output_dir`` is a file. OSError: a failed write.
    """
    import json

    out = ensure_output_dir(output_dir)
    png_tmp = os.path.join(out, f".passk.png.tmp-{os.getpid()}")
    try:
        plot_passk(result, png_tmp)
        with open(png_tmp, "rb") as f:
            png = f.read()
        os.replace(png_tmp, os.path.join(out, "passk.png"))
    finally:
        if os.path.exists(png_tmp):
            os.remove(png_tmp)
    result.png_path = os.path.join(out, "passk.png")
    page = render_html(result, png).encode("utf-8")
    result.html_path = _atomic_write(os.path.join(out, "passk.html"), page)
    text = json.dumps(plain(result.to_dict()), indent=2) + "\n"
    result.json_path = _atomic_write(os.path.join(out, "passk.json"), text.encode("utf-8"))
    return result


def check_model(spec: str, flag: str) -> None:
    """Resolve a model argument as ``policygrad eval --model`` does (a bundled model is converted
    on first use), so a wrong one fails before any model loads.

    Raises:
        ValueError: the spec's error, prefixed with ``flag``.
    """
    from policygrad.models.adapters import resolve_model_source

    try:
        resolve_model_source(spec)
    except (ValueError, TypeError, FileNotFoundError) as e:
        text = str(e).strip()
        for prefix in ("model: ", "model "):
            if text.startswith(prefix):
                text = text[len(prefix):]
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
                gen, models.tokenizer, rows, data=data, samples=samples, ks=ks, temperature=temperature,
                max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, reward_fn=reward_fn,
                label=label, model=spec, engine_name=name,
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
        "--dataset", default=DEFAULT_DATASET,
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
        "--threads", "--num-threads", dest="threads", type=int, default=None,
        help="torch intra-op threads (default: torch's)",
    )
    p.add_argument("--output-dir", "--out", dest="output_dir", default=DEFAULT_OUTPUT_DIR)
    return p


def main(argv: list[str]) -> str:
    """``policygrad lab passk --base M --trained M ...``: every flag is checked before a model
    loads."""
    from policygrad.config.train import RewardConfig, TrainConfig
    from policygrad.evaluate.command import eval_data_config  # the rows policygrad eval picks for these flags
    from policygrad.rewards.code import TaskReward

    args = build_parser().parse_args(argv)
    for flag, value in (("--limit", args.limit), ("--samples", args.samples),
                        ("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size)):
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
        args.base, args.trained, data=data, limit=args.limit, samples=args.samples, ks=ks,
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        engine=args.engine, seed=args.seed, output_dir=output_dir,
    )
    return "\n".join([
        result.table,
        f"\n{time.perf_counter() - t0:.0f} s in all",
        f"wrote {result.json_path}\nwrote {result.png_path}\nwrote {result.html_path}",
    ])
