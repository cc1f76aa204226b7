"""One self-contained HTML page about one or more training runs (``policygrad report``).

A run directory written by :class:`policygrad.trainer.loop.Trainer` holds ``metrics.jsonl`` (one
JSON row per step; held-out accuracy rows ``eval/accuracy`` at step 0 and after the last step),
``config.yaml`` (the resolved configuration), ``summary.json`` (after the run) and the
evaluations ``eval_before.jsonl`` / ``eval_stepN.jsonl`` / ``eval_after.jsonl`` (rows with
``prompt``, ``answer``, ``completion``, ``reward``).

The page shows, each as a PNG embedded in base64 (no external file), the usual PPO/GRPO
diagnostics (reward, held-out accuracy, KL to the reference, entropy, response length, clip
fraction, approx_kl, the critic's explained variance when there is a critic, and the time split
between generation and training; cf. the metrics logged in Huang et al. 2024, "The N+
Implementation Details of RLHF with PPO", and the training dynamics of Yu et al. 2025, DAPO),
one line per run on shared axes; the resolved config; and the best and worst completions of each
run's last evaluation.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import glob
import html
import io
import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from policygrad.arguments import OneLineArgumentParser
from policygrad.lab.common import (
    pyplot,
)
from policygrad.run.directory import config_file, eval_file, metrics_file, summary_file


@dataclasses.dataclass(frozen=True)
class PlotSpec:
    """One plot of the page.

    Fields:
        key: a metric name of ``metrics.jsonl``.
        title: caption shown under the image.
        ylabel: the y axis label.
        smooth: draw a moving average over the raw (faint) curve.
        constant_note: shown on the plot when every logged value is the same number.
    """

    key: str
    title: str
    ylabel: str
    smooth: bool = True
    constant_note: str = ""


_ON_POLICY = "expected with one epoch and one minibatch: the ratio pi/pi_old is then exactly 1"

PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward/mean", "Reward (mean over the step's samples)", "reward"),
    PlotSpec("eval/accuracy", "Held-out accuracy (greedy)", "accuracy", smooth=False),
    PlotSpec("kl/ref", "KL to the reference (k1, nats per token)", "KL"),
    PlotSpec("policy/entropy", "Policy entropy (nats per token)", "entropy"),
    PlotSpec("response/length_mean", "Response length (tokens)", "tokens"),
    PlotSpec("policy/clipfrac", "Clip fraction", "fraction of tokens", constant_note=_ON_POLICY),
    PlotSpec(
        "policy/approx_kl", "approx_kl (k3 of KL(pi_old || pi))", "nats per token", constant_note=_ON_POLICY
    ),
    PlotSpec("critic/explained_variance", "Critic explained variance", "explained variance"),
    PlotSpec("critic/vf_loss", "Critic value loss", "loss"),
    PlotSpec("optim/grad_norm", "Gradient norm (before clipping)", "norm"),
    PlotSpec("mismatch/logprob_abs_mean", "Sampler vs trainer log-prob mismatch (mean |delta|)", "nats"),
)
"""The per-metric plots, in page order; a plot appears when any run logged its metric."""

TIME_KEYS = ("time/generation_s", "time/training_s")
TIME_TITLE = "Time per step: generation vs training"


@dataclasses.dataclass
class Run:
    """What the page needs from one run directory.

    Fields:
        path: the directory; label: its name on the page.
        series: metric -> ``[(step, value)]`` (finite values only, in file order).
        config_text: ``config.yaml`` as text ("" when missing).
        summary: ``summary.json`` (empty when missing).
        eval_file: the evaluation file shown (or None); eval_rows: its rows.
    """

    path: str
    label: str
    series: dict[str, list[tuple[float, float]]]
    config_text: str
    summary: dict[str, Any]
    eval_file: str | None
    eval_rows: list[dict[str, Any]]


def _eval_order(path: str) -> tuple[int, float]:
    name = os.path.basename(path)
    if name == "eval_after.jsonl":
        return (3, 0.0)
    m = re.fullmatch(r"eval_step(\d+)\.jsonl", name)
    if m:
        return (2, float(m.group(1)))
    if name == "eval_before.jsonl":
        return (0, 0.0)
    return (1, os.path.getmtime(path))


def last_eval_file(run_dir: str) -> str | None:
    """``eval_after.jsonl`` if present, else the latest ``eval_stepN.jsonl`` (largest N), else
    the newest other ``eval_*.jsonl``, else ``eval_before.jsonl``; None when there is none."""
    files = glob.glob(eval_file(run_dir, "eval_*"))
    return max(files, key=_eval_order) if files else None


def _read_jsonl(path: str, what: str) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if n > 1 and not line.endswith("\n"):
                    break  # the last line of a file still being written
                raise ValueError(f"{path}: line {n} is not JSON ({what})") from None
            if isinstance(row, dict):
                rows.append(row)
    return rows


def load_run(run_dir: str, label: str | None = None) -> Run:
    """Read a run directory.

    Raises:
        FileNotFoundError: ``run_dir`` is not a folder, or has no ``metrics.jsonl`` (the message
            says what a run directory holds).
        ValueError: a line of ``metrics.jsonl`` that is not JSON.
    """
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory {run_dir!r} does not exist")
    metrics = metrics_file(run_dir)
    if not os.path.exists(metrics):
        raise FileNotFoundError(
            f"{run_dir!r} has no metrics.jsonl; give a directory written by `policygrad train` "
            "(its output_dir)"
        )
    series: dict[str, list[tuple[float, float]]] = {}
    for row in _read_jsonl(metrics, "metrics"):
        step = row.get("step")
        if not isinstance(step, (int, float)):
            continue
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                series.setdefault(key, []).append((float(step), float(value)))
    config_path = config_file(run_dir)
    config_text = ""
    if os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as f:
            config_text = f.read()
    summary_path = summary_file(run_dir)
    summary = {}
    if os.path.exists(summary_path):
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)
    eval_file = last_eval_file(run_dir)
    eval_rows = _read_jsonl(eval_file, "evaluation") if eval_file else []
    name = label or os.path.basename(os.path.normpath(run_dir)) or run_dir
    return Run(run_dir, name, series, config_text, summary, eval_file, eval_rows)


def _smooth(values: list[float]) -> list[float]:
    """Trailing moving average over a window of about 1/10 of the run (at least 1)."""
    w = max(1, len(values) // 10)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= w:
            total -= values[i - w]
        out.append(total / min(i + 1, w))
    return out


_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def _png_base64(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plot_metric(runs: Sequence[Run], spec: PlotSpec) -> str | None:
    """Base64 PNG of metric ``spec.key``, one line per run; None when no run logged it."""
    if not any(spec.key in r.series for r in runs):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for i, run in enumerate(runs):
        points = run.series.get(spec.key)
        if not points:
            continue
        color = _COLORS[i % len(_COLORS)]
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        if len(points) <= 12 or not spec.smooth:
            ax.plot(xs, ys, "o-", color=color, label=run.label, ms=4)
        else:
            ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
            ax.plot(xs, _smooth(ys), color=color, lw=1.6, label=f"{run.label} (moving average)")
    values = [v for r in runs for _, v in r.series.get(spec.key, [])]
    if len(values) > 1 and min(values) == max(values):
        note = f"constant {values[0]:g} at every step"
        if values[0] == 0 and spec.constant_note:
            note += f"\n({spec.constant_note})"
        ax.text(0.5, 0.65, note, transform=ax.transAxes, ha="center", va="center", fontsize=8, color="#444")
    ax.set_xlabel("step")
    ax.set_ylabel(spec.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png_base64(fig)


def plot_time(runs: Sequence[Run]) -> str | None:
    """Base64 PNG of seconds per step in generation (solid) and training (dashed) per run."""
    if not any(k in r.series for r in runs for k in TIME_KEYS):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for i, run in enumerate(runs):
        color = _COLORS[i % len(_COLORS)]
        for key, style in zip(TIME_KEYS, ("-", "--")):
            points = run.series.get(key)
            if not points:
                continue
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            if len(points) > 12:
                ys = _smooth(ys)
            part = "generation" if "generation" in key else "training"
            total = sum(p[1] for p in points)
            ax.plot(xs, ys, style, color=color, label=f"{run.label}: {part} ({total / 60:.1f} min total)")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png_base64(fig)


def _completion_block(rows: list[dict[str, Any]], title: str) -> str:
    if not rows:
        return f"<h4>{html.escape(title)}</h4><p class='muted'>none</p>"
    items = []
    for r in rows:
        items.append(
            "<div class='sample'>"
            f"<div><b>prompt</b> {html.escape(str(r.get('prompt', '')))}</div>"
            f"<div><b>answer</b> {html.escape(str(r.get('answer', '')))} &nbsp; <b>reward</b> "
            f"{html.escape(str(r.get('reward', '')))}</div>"
            f"<pre>{html.escape(str(r.get('completion', '')))}</pre></div>"
        )
    return f"<h4>{html.escape(title)}</h4>" + "".join(items)


def _samples(rows: list[dict[str, Any]], k: int) -> tuple[list[dict], list[dict]]:
    """Best = rows with reward 1 (or the highest rewards when none is 1), worst = reward 0 (or the
    lowest); ``k`` of each, in file order."""
    scored = [r for r in rows if isinstance(r.get("reward"), (int, float))]
    if not scored:
        return [], []
    best = [r for r in scored if r["reward"] == 1]
    worst = [r for r in scored if r["reward"] == 0]
    if not best:
        top = max(r["reward"] for r in scored)
        best = [r for r in scored if r["reward"] == top]
    if not worst:
        bottom = min(r["reward"] for r in scored)
        worst = [r for r in scored if r["reward"] == bottom and r not in best]
    return best[:k], worst[:k]


REPORT_CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
.grid { display: flex; flex-wrap: wrap; gap: 12px; }
figure { margin: 0; width: 540px; }
figure img { width: 100%; border: 1px solid #eee; }
figcaption { font-size: .9em; color: #444; text-align: center; }
pre { background: #f6f8fa; padding: .6em; overflow-x: auto; font-size: .85em; white-space: pre-wrap; }
.sample { border-left: 3px solid #ccc; padding-left: .6em; margin-bottom: .8em; font-size: .9em; }
table { border-collapse: collapse; font-size: .9em; } td, th { border: 1px solid #ddd; padding: .2em .6em; }
.muted { color: #888; }
"""


def _summary_table(runs: Sequence[Run]) -> str:
    keys = ["steps", "accuracy_before", "accuracy_after", "accuracy_gain", "train_minutes", "peak_rss_gb"]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ["run", *keys])
    body = []
    for r in runs:
        cells = [html.escape(r.label)]
        steps = r.summary.get("steps")
        if steps is None and r.series:
            steps = int(max(p[0] for s in r.series.values() for p in s))
        for k in keys:
            v = steps if k == "steps" else r.summary.get(k)
            cells.append("-" if v is None else html.escape(f"{v:.4g}" if isinstance(v, float) else str(v)))
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def render_report(runs: Sequence[Run], *, samples: int = 3) -> tuple[str, list[str]]:
    """The HTML page for ``runs`` and the captions of the plots it holds (page order)."""
    figures: list[tuple[str, str]] = []
    for spec in PLOTS:
        img = plot_metric(runs, spec)
        if img is not None:
            figures.append((spec.title, img))
    time_img = plot_time(runs)
    if time_img is not None:
        figures.append((TIME_TITLE, time_img))
    labels = ", ".join(r.label for r in runs)
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>policygrad report: {html.escape(labels)}</title><style>{REPORT_CSS}</style></head><body>",
        f"<h1>policygrad report: {html.escape(labels)}</h1>",
        "<p class='muted'>" + "<br>".join(html.escape(os.path.abspath(r.path)) for r in runs) + "</p>",
        "<h2>Summary</h2>",
        _summary_table(runs),
        "<h2>Curves</h2><div class='grid'>",
    ]
    for caption, img in figures:
        parts.append(
            f'<figure><img src="data:image/png;base64,{img}" alt="{html.escape(caption)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        )
    parts.append("</div>")
    if not figures:
        parts.append("<p class='muted'>no metric rows yet</p>")
    parts.append("<h2>Completions of the last evaluation</h2>")
    for r in runs:
        parts.append(f"<h3>{html.escape(r.label)}</h3>")
        if not r.eval_rows:
            parts.append("<p class='muted'>no evaluation file</p>")
            continue
        rewards = [x["reward"] for x in r.eval_rows if isinstance(x.get("reward"), (int, float))]
        acc = sum(rewards) / len(rewards) if rewards else float("nan")
        parts.append(
            f"<p>{html.escape(os.path.basename(r.eval_file))}: {len(r.eval_rows)} problems, "
            f"mean reward {acc:.3f}</p>"
        )
        best, worst = _samples(r.eval_rows, samples)
        parts.append(_completion_block(best, "Best (reward 1)"))
        parts.append(_completion_block(worst, "Worst (reward 0)"))
    parts.append("<h2>Configuration</h2>")
    for r in runs:
        parts.append(
            f"<h3>{html.escape(r.label)}</h3><pre>{html.escape(r.config_text or '(no config.yaml)')}</pre>"
        )
    parts.append("</body></html>")
    return "\n".join(parts), [caption for caption, _ in figures]


def _labels(run_dirs: Sequence[str]) -> list[str]:
    names = [os.path.basename(os.path.normpath(d)) or d for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [os.path.normpath(d) for d in run_dirs]


@dataclasses.dataclass
class ReportResult:
    """Fields: path (the HTML written), captions (plots on the page), runs (labels)."""

    path: str
    captions: list[str]
    runs: list[str]


def write_report(run_dirs: Sequence[str], output: str | None = None, *, samples: int = 3) -> ReportResult:
    """Render the page for ``run_dirs`` and write it to ``output``.

    Args:
        run_dirs: one or more run directories (several: compared on the same axes).
        output: the HTML path; default ``RUN_DIR/report.html`` for one run, ``report.html`` for several.
        samples: completions shown per kind (best / worst).

    Raises:
        ValueError: no run directory. FileNotFoundError: see :func:`load_run`.
    """
    if not run_dirs:
        raise ValueError("give at least one run directory: policygrad report RUN_DIR [RUN_DIR ...]")
    runs = [load_run(d, label) for d, label in zip(run_dirs, _labels(run_dirs))]
    page, captions = render_report(runs, samples=samples)
    if output is None:
        output = os.path.join(run_dirs[0], "report.html") if len(run_dirs) == 1 else "report.html"
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
        f.write(page)
    return ReportResult(output, captions, [r.label for r in runs])


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="policygrad report",
        description="One self-contained HTML page with a run's curves, config and best/worst completions; "
        "several runs are compared on the same axes.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument(
        "--output",
        default=None,
        help="HTML file (default RUN_DIR/report.html for one run, ./report.html for several)",
    )
    p.add_argument("--samples", type=int, default=3, help="best and worst completions shown per run")
    return p


def main(argv: list[str]) -> str:
    """``policygrad report RUN_DIR [RUN_DIR ...] [--output FILE]``."""
    args = build_parser().parse_args(argv)
    if args.samples < 0:
        raise ValueError(f"--samples must be >= 0, got {args.samples}")
    result = write_report(args.run_dirs, args.output, samples=args.samples)
    lines = [f"{len(result.captions)} plots: " + "; ".join(result.captions)]
    lines.append(f"wrote {result.path}")
    return "\n".join(lines)
