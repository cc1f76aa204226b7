"""Tests of ``policygrad report``: every plot of a synthetic run is on the page, images are
embedded, completions are escaped, several runs share the axes, bad directories fail cleanly."""

from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
import subprocess

import pytest

from policygrad.cli import main
from policygrad.lab.report import PLOTS, TIME_TITLE, last_eval_file, load_run, write_report

pytestmark = pytest.mark.integration

IMG = '<img src="data:image/png;base64,'


def make_run(path, *, steps=30, critic=True, scale=1.0):
    """A run directory with every metric the page plots, a config, and two evaluations."""
    os.makedirs(path, exist_ok=True)
    rows = [{"step": 0, "eval/accuracy": 0.2}]
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "reward/mean": scale * s / steps,
            "kl/ref": 0.01 * s,
            "policy/entropy": 1.0 - 0.01 * s,
            "response/length_mean": 20 + s,
            "policy/clipfrac": 0.05,
            "policy/approx_kl": 0.001,
            "optim/grad_norm": 1.0,
            "mismatch/logprob_abs_mean": 1e-6,
            "time/generation_s": 2.0,
            "time/training_s": 1.0,
            "reward/std": None,  # a NaN logged as null: skipped
        }
        if critic:
            row["critic/explained_variance"] = -0.5 + s / steps
            row["critic/vf_loss"] = 1.0 / s
        rows.append(row)
    rows.append({"step": steps, "eval/accuracy": 0.4})
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(path, "config.yaml"), "w") as f:
        f.write("algorithm: grpo\nsteps: 30\nkl:\n  beta: 0.04\n")
    evals = [
        {"prompt": "What is 1 + 1?", "answer": "2", "completion": "2", "reward": 1.0},
        {"prompt": "What is 2 + 2?", "answer": "4", "completion": "<b>5</b> & more", "reward": 0.0},
    ]
    with open(os.path.join(path, "eval_before.jsonl"), "w") as f:
        f.write(json.dumps({"prompt": "old", "answer": "0", "completion": "stale", "reward": 0.0}) + "\n")
    with open(os.path.join(path, "eval_after.jsonl"), "w") as f:
        for row in evals:
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(path, "summary.json"), "w") as f:
        json.dump({"steps": steps, "accuracy_before": 0.2, "accuracy_after": 0.4}, f)
    return str(path)


def test_every_plot_is_on_the_page(tmp_path):
    run = make_run(tmp_path / "run_a")
    result = write_report([run])
    assert result.path == os.path.join(run, "report.html")
    page = open(result.path, encoding="utf-8").read()
    expected = [spec.title for spec in PLOTS] + [TIME_TITLE]
    assert result.captions == expected
    assert page.count(IMG) == len(expected) == 12
    for caption in expected:
        assert f"<figcaption>{html.escape(caption)}</figcaption>" in page
    # The last evaluation (eval_after), escaped; the stale eval_before is not shown.
    assert "&lt;b&gt;5&lt;/b&gt; &amp; more" in page and "<b>5</b>" not in page
    assert "stale" not in page
    assert "beta: 0.04" in page  # the config
    assert 'src="http' not in page and "<link" not in page and "<script" not in page  # self-contained


def test_missing_metrics_leave_their_plots_out(tmp_path):
    run = make_run(tmp_path / "no_critic", critic=False)
    result = write_report([run], str(tmp_path / "out" / "r.html"))
    assert "Critic explained variance" not in result.captions
    assert "Critic value loss" not in result.captions
    assert open(result.path).read().count(IMG) == len(result.captions) == 10


def test_several_runs_share_the_axes(tmp_path):
    a = make_run(tmp_path / "a" / "run")
    b = make_run(tmp_path / "b" / "run", critic=False, scale=0.5)
    result = write_report([a, b], str(tmp_path / "compare.html"))
    page = open(result.path).read()
    # Equal folder names are told apart by their paths.
    assert result.runs == [os.path.normpath(a), os.path.normpath(b)]
    assert page.count(IMG) == 12  # one image per metric, both runs on it
    assert page.count("<h3>") == 4  # completions and config of each run


def test_run_reading(tmp_path):
    run = make_run(tmp_path / "r", steps=5)
    loaded = load_run(run)
    assert loaded.series["eval/accuracy"] == [(0.0, 0.2), (5.0, 0.4)]
    assert len(loaded.series["reward/mean"]) == 5
    assert "reward/std" not in loaded.series
    assert os.path.basename(last_eval_file(run)) == "eval_after.jsonl"
    os.remove(os.path.join(run, "eval_after.jsonl"))
    for n in (10, 2):
        open(os.path.join(run, f"eval_step{n}.jsonl"), "w").close()
    assert os.path.basename(last_eval_file(run)) == "eval_step10.jsonl"
    assert all(math.isfinite(v) for _, v in loaded.series["reward/mean"])


def test_bad_run_dirs(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="has no metrics.jsonl"):
        load_run(str(tmp_path))
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "error: run directory" in capsys.readouterr().err
    run = make_run(tmp_path / "ok", steps=3)
    assert main(["report", run, "--output", str(tmp_path / "x.html")]) == 0
    out = capsys.readouterr().out
    assert "12 plots" in out and "x.html" in out


PROBE = """<script>window.addEventListener('load', () => {
  const images = [...document.images];
  document.body.dataset.images = images.length;
  document.body.dataset.broken = images.filter(i => !i.complete || i.naturalWidth === 0).length;
  document.body.dataset.tables = document.querySelectorAll('table').length;
  console.log('probe done');
});</script>"""


def render(browser: str, path) -> tuple[dict[str, int], list[str]]:
    """``(the probe's counts, the console's lines)`` of ``path`` rendered in headless Chromium."""
    done = subprocess.run(
        [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=5000", "--dump-dom", f"file://{path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", done.stdout).group(1)
    counts = {k: int(v) for k, v in re.findall(r'data-(\w+)="(\d+)"', body)}
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return counts, console


def test_the_page_renders_in_a_real_browser(tmp_path):
    """Every plot decodes and the tables render in headless Chromium, with nothing on its console
    but the probe's line; a page with one broken image is caught, so the check can fail."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no Chromium here (apt-get install chromium; CI installs it)")
    page = open(write_report([make_run(tmp_path / "run")]).path, encoding="utf-8").read()
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    counts, console = render(browser, probe)
    assert counts == {"images": 12, "broken": 0, "tables": page.count("<table")} and counts["tables"] >= 1
    assert len(console) == 1 and "probe done" in console[0], console
    broken = page.replace("</body>", '<img src="data:image/png;base64,AAAA">' + PROBE + "</body>")
    probe.write_text(broken, encoding="utf-8")
    assert render(browser, probe)[0]["broken"] == 1
