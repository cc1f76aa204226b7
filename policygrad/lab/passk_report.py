"""The result of ``policygrad lab passk`` (the protocol: :mod:`policygrad.lab.passk`): one model's
measurement, the comparison of two, its table, its plot, one self-contained HTML page, and the
three files, each written to a temporary name and renamed into place."""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import os
from typing import Any

from policygrad.lab.common import (
    ensure_output_dir,
    format_table,
    plain,
    pyplot,
    save_figure,
)


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
    rows = [
        [f"pass@{k}", base.pass_at_k[k], trained.pass_at_k[k], trained.pass_at_k[k] - base.pass_at_k[k]]
        for k in result.ks
    ]
    rows.append(
        [
            "greedy",
            base.greedy_accuracy,
            trained.greedy_accuracy,
            trained.greedy_accuracy - base.greedy_accuracy,
        ]
    )
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
    return "\n".join(
        [
            "<!DOCTYPE html><html><head><meta charset='utf-8'>",
            f"<title>policygrad lab passk</title><style>{REPORT_CSS}</style></head><body>",
            "<h1>pass@k: base vs trained</h1>",
            "<p>"
            + "<br>".join(
                f"{m.label}: <code>{esc(m.model)}</code> ({esc(m.engine)}, {m.seconds:.0f} s generating and "
                f"scoring, {m.load_seconds:.0f} s loading)"
                for m in (base, trained)
            )
            + "</p>",
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
        ]
    )


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
