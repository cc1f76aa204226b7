"""How policygrad's step time and memory grow with the work: G and the response length.

Points: G in {2, 4, 8, 16} at 64 new tokens, and at most {32, 64, 128, 256} new tokens at G = 4,
always 4 prompts per step (B = 4 x G sequences), GRPO without a KL term, float32, the bundled
SmolLM2-135M-Instruct. The prompts ask for long stories, so responses run to the length limit
(the table gives the lengths actually reached), and the reward is a random 0/1 per completion
(a ``path.py:function`` reward in policygrad's protocol): the step's cost does not depend on what
is learned.

Each point runs in a fresh worker process (its own peak RSS): ``--warmup`` unmeasured steps, then
``--steps`` measured steps, medians reported. The script also measures this machine's float32
matmul peak (2048 x 2048 x 2048 ``torch.matmul``, median of several, before and after the
points) and reports the training phase's throughput as

    FLOP/s = 6 x n_params x (prompt + response tokens of the batch) / time/training_s

(forward 2N + backward 4N per token, every row's prompt and response, non-padding: the work a
trainer that runs each row whole must do, the count the model-FLOP utilisation of the field
uses) and its fraction of the peak. policygrad does less than that: each distinct prompt runs
once, responses are packed without padding, and the lm_head runs only at response tokens (with
one recomputation in the backward), so the script also gives the FLOP/s it actually executes,

    6 x n_body x (distinct prompt tokens + response tokens) + 8 x n_lm_head x response tokens,

divided by the same time: how close the hardware runs to its matmul peak. The exponent k of
step time ~ x^k is fitted on log-log axes for x = G and
x = the length limit (and the mean response length actually reached).

Usage::

    python benchmarks/scaling.py --quick --pg-engine hf
    python benchmarks/scaling.py --update-readme

Writes ``benchmarks/results/<date>-scaling.json``, ``<date>-scaling.png`` and prints a markdown
table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    Worker,
    add_common_options,
    as_float,
    fmt,
    log_dir,
    loglog_slope,
    machine_description,
    machine_line,
    markdown_table,
    median,
    nan_to_none,
    new_result_path,
    policygrad_config,
    run_main,
    serve_policygrad,
    today,
    update_readme_section,
    warn_if_busy,
    write_json,
)

MODEL = "bundled:smollm2-135m-instruct"
README_SECTION = "scaling"
GROUP_SIZES = (2, 4, 8, 16)
LENGTHS = (32, 64, 128, 256)
BASE_G = 4
BASE_LENGTH = 64
PROMPTS_PER_STEP = 4

STORY_TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "two rival bakers in a small mountain village",
    "a robot that learns to paint",
    "a family moving across the country in an old van",
    "a young astronomer who discovers a new comet",
    "a detective solving a mystery on a night train",
    "a girl who can talk to the birds in her garden",
    "the last day of a travelling circus",
    "a sailor lost at sea who reaches an unknown island",
    "a library where the books rewrite themselves at night",
    "a beekeeper and the winter that never ended",
    "a chess player preparing for the final of a tournament",
    "a boy who builds a raft to cross a great river",
    "a city where it rains only on Sundays",
    "an old clockmaker and his mysterious apprentice",
    "a group of friends hiking to a hidden lake",
)
PROMPT_TEMPLATE = (
    "Write a long, detailed story about {topic}. Describe the places, the people and everything "
    "that happens to them, over many paragraphs."
)
REWARD_SOURCE = '''"""Random 0/1 rewards, seeded: the scaling benchmark times a step, not what it learns."""

import random

_rng = random.Random(0)


def random_reward(prompts, completions, **fields):
    return [float(_rng.random() < 0.5) for _ in completions]
'''


def write_inputs(folder: Path) -> tuple[str, str]:
    """The story prompts (JSONL) and the random reward (``path.py:function``) in ``folder``."""
    prompts = folder / "story_prompts.jsonl"
    with open(prompts, "w", encoding="utf-8") as f:
        for topic in STORY_TOPICS:
            # The trainer's dataset loader insists on an answer field even when no reward reads it.
            row = {"prompt": PROMPT_TEMPLATE.format(topic=topic), "answer": "none"}
            f.write(json.dumps(row) + "\n")
    reward = folder / "random_reward.py"
    reward.write_text(REWARD_SOURCE, encoding="utf-8")
    return str(prompts), f"{reward}:random_reward"


def settings(*, group_size: int, max_new_tokens: int, dataset: str, reward: str, args, output_dir: str):
    """The policygrad config of one point (a nested dict for ``load_config``)."""
    return {
        "algorithm": "grpo",
        "steps": args.warmup + args.steps,
        "seed": args.seed,
        "output_dir": output_dir,
        "overwrite": True,
        "max_minutes": None,
        "eval_before": False,
        "eval_after": False,
        "eval_every": 0,
        "save_every": 0,
        "log_completions": 0,
        "num_threads": args.threads,
        "tensorboard": False,
        "progress": False,
        "model": {"name": MODEL, "dtype": "float32"},
        "data": {"dataset": dataset, "eval_size": 0},
        "rollout": {
            "engine": args.pg_engine,
            "prompts_per_step": PROMPTS_PER_STEP,
            "group_size": group_size,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "max_new_tokens": max_new_tokens,
        },
        "reward": {"functions": [reward]},
        "kl": {"placement": "none", "beta": 0.0},
        "optim": {
            "lr": 2e-5,
            "schedule": "constant",
            "max_grad_norm": 1.0,
            "ppo_epochs": 1,
            "num_minibatches": 1,
        },
    }


def matmul_peak(threads: int, n: int = 2048, reps: int = 10) -> dict[str, Any]:
    """float32 ``torch.matmul`` of two n x n matrices: 2 n^3 FLOP per call; median and best
    GFLOP/s over ``reps`` timed calls after 3 warm-up calls."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=torch.float32)
    b = torch.randn(n, n, dtype=torch.float32)
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - start)
    flop = 2.0 * n**3
    return {
        "n": n,
        "reps": reps,
        "threads": torch.get_num_threads(),
        "times_s": times,
        "gflops_median": flop / statistics.median(times) / 1e9,
        "gflops_best": flop / min(times) / 1e9,
    }


def body_and_head_params(ready: dict[str, Any]) -> tuple[int, int]:
    """(parameters used at every position, lm_head parameters) of the policy: the embedding
    lookup does no matmul, and policygrad runs the lm_head only at response positions."""
    n, emb, head = (int(ready.get(k) or 0) for k in ("n_params", "n_embedding", "n_lm_head"))
    body = n - emb - (0 if ready.get("tied_embeddings") else head)
    return body, head


def point_summary(
    steps: list[dict[str, Any]], n_params: int, peak_gflops: float, params: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Medians of one point's measured steps, with the training phase's FLOP/s: the headline
    6 x n_params x tokens (every row's prompt and response), and (``params`` = (body, lm_head))
    the FLOP/s executed, 6 x body x tokens computed + 8 x lm_head x response tokens."""

    def m(key):
        return [as_float(s.get("metrics", {}).get(key)) for s in steps]

    out: dict[str, Any] = {
        "step_s": median(s["wall_s"] for s in steps),
        "generation_s": median(m("time/generation_s")),
        "training_s": median(m("time/training_s")),
        "forward_s": median(m("time/forward_s")),
        "backward_s": median(m("time/backward_s")),
        "optimizer_s": median(m("time/optimizer_s")),
        "weight_sync_s": median(m("time/weight_sync_s")),
        "batch": median(s.get("batch") for s in steps),
        "prompt_tokens": median(s.get("prompt_tokens") for s in steps),
        "response_tokens": median(s.get("response_tokens") for s in steps),
        "response_length_mean": median(
            as_float(s.get("response_tokens")) / as_float(s.get("batch")) for s in steps
        ),
        "truncated_frac": median(s.get("truncated_frac") for s in steps),
        "padded_tokens": median(
            as_float(s.get("batch"))
            * (as_float(s.get("prompt_len_padded")) + as_float(s.get("response_len_padded")))
            for s in steps
        ),
    }
    tokens = [as_float(s.get("prompt_tokens")) + as_float(s.get("response_tokens")) for s in steps]
    out["tokens"] = median(tokens)
    flops = [
        6.0 * n_params * t / as_float(s["metrics"].get("time/training_s")) for t, s in zip(tokens, steps)
    ]
    out["training_gflops"] = median(f / 1e9 for f in flops)
    out["training_peak_fraction"] = out["training_gflops"] / peak_gflops if peak_gflops else math.nan
    fbo = [
        as_float(s["metrics"].get("time/forward_s"))
        + as_float(s["metrics"].get("time/backward_s"))
        + as_float(s["metrics"].get("time/optimizer_s"))
        for s in steps
    ]
    out["fwd_bwd_opt_gflops"] = median(6.0 * n_params * t / f / 1e9 for t, f in zip(tokens, fbo))
    if params is not None and all(s.get("distinct_prompt_tokens") is not None for s in steps):
        body, head = params
        executed = [
            (
                6.0 * body * (as_float(s["distinct_prompt_tokens"]) + as_float(s.get("response_tokens")))
                + 8.0 * head * as_float(s.get("response_tokens"))
            )
            / as_float(s["metrics"].get("time/training_s"))
            / 1e9
            for s in steps
        ]
        out["computed_tokens"] = median(
            as_float(s["distinct_prompt_tokens"]) + as_float(s.get("response_tokens")) for s in steps
        )
        out["executed_gflops"] = median(executed)
        out["executed_peak_fraction"] = out["executed_gflops"] / peak_gflops if peak_gflops else math.nan
    return out


def run_point(args, g: int, length: int, dataset: str, reward: str, logs: Path) -> dict[str, Any]:
    """One point in a fresh worker: warm-up and measured steps."""
    tag = f"G{g}-L{length}"
    scratch = Path(tempfile.mkdtemp(prefix=f"pg-bench-scaling-{tag}-"))
    base = settings(
        group_size=g,
        max_new_tokens=length,
        dataset=dataset,
        reward=reward,
        args=args,
        output_dir=str(scratch / "run"),
    )
    policygrad_config(base, args.pg_override)  # validate before starting the worker
    spec_path = scratch / "spec.json"
    spec_path.write_text(
        json.dumps({"config": base, "overrides": list(args.pg_override), "threads": args.threads}),
        encoding="utf-8",
    )
    worker = Worker(
        [sys.executable, str(Path(__file__).resolve()), "--worker", "--spec", str(spec_path)],
        name=f"policygrad worker ({tag})",
        log_path=logs / f"{tag}.log",
        threads=args.threads,
    )
    replies = []
    final = None
    try:
        ready = worker.receive(args.load_timeout)
        for i in range(args.warmup + args.steps):
            reply = worker.request({"cmd": "step"}, args.step_timeout)
            reply["warmup"] = i < args.warmup
            replies.append(reply)
            label = "warm-up" if reply["warmup"] else f"{i - args.warmup + 1}/{args.steps}"
            mean_len = as_float(reply.get("response_tokens")) / as_float(reply.get("batch"))
            _say(
                f"[G={g:2d} L={length:3d}] step {label:7s} {reply['wall_s']:7.2f} s  "
                f"mean response length {mean_len:.1f}"
            )
    finally:
        final = worker.close()
        shutil.rmtree(scratch, ignore_errors=True)  # the spec and the run folder; the log stays
    peaks = [as_float(r.get("peak_rss_gb")) for r in replies] + [as_float((final or {}).get("peak_rss_gb"))]
    return {
        "group_size": g,
        "max_new_tokens": length,
        "ready": ready,
        "steps": replies,
        "peak_rss_gb": max((p for p in peaks if math.isfinite(p)), default=math.nan),
        "peak_rss_tree_gb": worker.tree_rss_peak_gb,
        "log": str(worker.log_path),
    }


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def fits(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Log-log slopes of step, generation and training time along each axis."""
    out: dict[str, Any] = {}
    axes = {
        "G": ([p for p in points if p["max_new_tokens"] == BASE_LENGTH], "group_size"),
        "length": ([p for p in points if p["group_size"] == BASE_G], "max_new_tokens"),
    }
    for axis, (pts, key) in axes.items():
        pts = sorted(pts, key=lambda p: p[key])
        xs = [p[key] for p in pts]
        out[axis] = {
            "x": xs,
            "step": loglog_slope(xs, [p["summary"]["step_s"] for p in pts]),
            "generation": loglog_slope(xs, [p["summary"]["generation_s"] for p in pts]),
            "training": loglog_slope(xs, [p["summary"]["training_s"] for p in pts]),
            "peak_rss": loglog_slope(xs, [p["peak_rss_gb"] for p in pts]),
        }
        if axis == "length":
            lengths = [p["summary"]["response_length_mean"] for p in pts]
            out[axis]["step_vs_mean_response_length"] = loglog_slope(
                lengths, [p["summary"]["step_s"] for p in pts]
            )
    return out


def plot(points: list[dict[str, Any]], fit: dict[str, Any], path: Path, title: str) -> None:
    """Step time and its generation/training parts against G and against the length limit, on
    log-log axes, with a linear reference through the first point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    panels = (
        (
            "G",
            "group_size",
            BASE_LENGTH,
            "max_new_tokens",
            f"G (samples per prompt), {BASE_LENGTH} new tokens",
        ),
        ("length", "max_new_tokens", BASE_G, "group_size", f"max new tokens, G = {BASE_G}"),
    )
    for ax, (axis, key, fixed, fixed_key, label) in zip(axes, panels):
        pts = sorted((p for p in points if p[fixed_key] == fixed), key=lambda p: p[key])
        if not pts:
            ax.set_visible(False)
            continue
        xs = [p[key] for p in pts]
        for name, field, style in (
            ("step", "step_s", "o-"),
            ("generation", "generation_s", "s--"),
            ("training", "training_s", "^--"),
        ):
            ys = [p["summary"][field] for p in pts]
            ax.plot(xs, ys, style, label=f"{name} (slope {fmt(fit[axis][name])})")
        y0 = pts[0]["summary"]["step_s"]
        ax.plot(xs, [y0 * x / xs[0] for x in xs], ":", color="gray", label="linear (slope 1)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel(label)
        ax.set_ylabel("seconds per step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(result: dict[str, Any]) -> str:
    """The markdown block printed at the end and written into the README section."""
    peak = result["matmul_peak_gflops"]
    s = result["settings"]
    rows = []
    for p in result["points"]:
        q = p["summary"]
        rows.append(
            [
                p["group_size"],
                p["max_new_tokens"],
                fmt(q["batch"], 0),
                fmt(q["response_length_mean"], 1),
                fmt(q["tokens"], 0),
                fmt(q["step_s"]),
                fmt(q["generation_s"]),
                fmt(q["training_s"]),
                fmt(q["training_gflops"], 0),
                fmt(100 * q["training_peak_fraction"], 0),
                fmt(q.get("computed_tokens", math.nan), 0),
                fmt(q.get("executed_gflops", math.nan), 0),
                fmt(100 * as_float(q.get("executed_peak_fraction", math.nan)), 0),
                fmt(p["peak_rss_gb"]),
            ]
        )
    header = [
        "G",
        "max new tokens",
        "B",
        "mean response length",
        "tokens (prompt + response)",
        "step (s)",
        "generation (s)",
        "training (s)",
        "training GFLOP/s (6N x tokens)",
        "% of matmul peak",
        "tokens computed",
        "executed GFLOP/s",
        "executed % of peak",
        "peak RSS (GB)",
    ]
    f = result["fits"]
    head = result["n_params_body_lm_head"][1]
    lines = [
        f"Measured {result['date']} with `{result['command']}` on {machine_line(result['machine'])}; "
        f"{s['threads']} threads; rollout engine {result['engine']}; "
        f"medians of {s['steps']} measured step(s) after {s['warmup']} warm-up step(s) per point, "
        "each point in a fresh process" + (" (quick mode)" if s["quick"] else "") + ".",
        "",
        markdown_table(header, rows),
        "",
        f"float32 matmul peak (2048^3): {fmt(peak, 0)} GFLOP/s. Training GFLOP/s = 6 x "
        f"{result['n_params'] / 1e6:.1f}M params x tokens (every row's prompt and response) / "
        "time/training_s, the model-FLOP count. Executed GFLOP/s counts what policygrad runs: "
        f"6 x body x tokens computed (each distinct prompt once, responses without padding) + 8 x "
        f"{head / 1e6:.1f}M lm_head x response tokens (forward, recomputation and backward), over the "
        "same time.",
        "",
        "Exponent k of time ~ x^k (log-log least squares): "
        f"along G: step {fmt(f['G']['step'])}, generation {fmt(f['G']['generation'])}, "
        f"training {fmt(f['G']['training'])}; along the length limit: step {fmt(f['length']['step'])}, "
        f"generation {fmt(f['length']['generation'])}, training {fmt(f['length']['training'])} "
        "(step against the mean response length reached: "
        f"{fmt(f['length'].get('step_vs_mean_response_length'))}).",
        "",
        f"![step time against G and length]({result['plot_relpath']})",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="measured steps per point")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up steps per point")
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 1 measured step per point")
    parser.add_argument(
        "--groups", default=",".join(map(str, GROUP_SIZES)), help=f"G values at {BASE_LENGTH} tokens"
    )
    parser.add_argument(
        "--lengths", default=",".join(map(str, LENGTHS)), help=f"length limits at G = {BASE_G}"
    )
    add_common_options(parser, "scaling")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        serve_policygrad(json.loads(args.spec.read_text(encoding="utf-8")))
        return 0
    if args.quick:
        args.warmup, args.steps = 1, 1
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--steps must be >= 1, --warmup >= 0, --threads >= 1")
    try:
        groups = [int(x) for x in args.groups.split(",") if x.strip()]
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        parser.error("--groups and --lengths take comma-separated integers, e.g. 2,4,8,16")
    if any(g < 2 for g in groups) or any(n < 1 for n in lengths):
        parser.error("--groups needs G >= 2 (GRPO compares samples of a prompt), --lengths >= 1")
    grid: list[tuple[int, int]] = [(g, BASE_LENGTH) for g in groups]
    grid += [(BASE_G, n) for n in lengths if (BASE_G, n) not in grid]

    machine = machine_description()
    warn_if_busy(machine)
    logs = log_dir("scaling")
    _say(f"worker logs: {logs}")
    dataset, reward = write_inputs(logs)
    started = time.perf_counter()
    before = matmul_peak(args.threads)
    _say(
        f"matmul peak before: {before['gflops_median']:.0f} GFLOP/s median, {before['gflops_best']:.0f} best"
    )
    points = []
    for g, n in grid:
        points.append(run_point(args, g, n, dataset, reward, logs))
    after = matmul_peak(args.threads)
    _say(f"matmul peak after:  {after['gflops_median']:.0f} GFLOP/s median, {after['gflops_best']:.0f} best")
    peak = max(before["gflops_median"], after["gflops_median"])
    n_params = int(points[0]["ready"]["n_params"])
    params = body_and_head_params(points[0]["ready"])
    for p in points:
        p["summary"] = point_summary([s for s in p["steps"] if not s["warmup"]], n_params, peak, params)
    date = today()
    out = args.output or new_result_path("scaling", date)
    png = out.with_suffix(".png")
    result: dict[str, Any] = {
        "benchmark": "scaling",
        "date": date,
        "command": " ".join(["python", "benchmarks/scaling.py", *sys.argv[1:]]),
        "machine": machine,
        "settings": {
            "model": MODEL,
            "prompts_per_step": PROMPTS_PER_STEP,
            "groups": groups,
            "lengths": lengths,
            "steps": args.steps,
            "warmup": args.warmup,
            "quick": args.quick,
            "seed": args.seed,
            "threads": args.threads,
            "pg_engine": args.pg_engine,
            "pg_overrides": args.pg_override,
            "prompts": [PROMPT_TEMPLATE.format(topic=t) for t in STORY_TOPICS],
            "reward": "random 0/1 per completion (seeded)",
            "flops_formula": "6 x n_params x (non-padding prompt + response tokens) / time/training_s",
        },
        "engine": points[0]["ready"].get("engine"),
        "n_params": n_params,
        "n_params_body_lm_head": list(params),
        "matmul_peak_gflops": peak,
        "matmul": {"before": before, "after": after},
        "points": points,
        "plot": str(png),
    }
    try:
        result["plot_relpath"] = str(png.resolve().relative_to(Path(__file__).resolve().parent))
    except ValueError:
        result["plot_relpath"] = str(png)
    result["fits"] = fits(points)
    result["wall_minutes"] = (time.perf_counter() - started) / 60
    try:
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    write_json(out, nan_to_none(result))
    title = f"policygrad GRPO step, {machine_line(machine)}, engine {result['engine']}"
    plot(points, result["fits"], png, title)
    text = report(result)
    print(text)
    _say(f"wrote {out} and {png} ({result['wall_minutes']:.1f} min)")
    if args.update_readme:
        update_readme_section(README_SECTION, text)
        _say(f"updated the '{README_SECTION}' section of benchmarks/README.md")
    return 0


if __name__ == "__main__":
    run_main(main)
