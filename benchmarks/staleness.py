"""The default job at ``rollout.max_staleness`` 0 and 1, one after the other on this machine.

```bash
python benchmarks/staleness.py                     # 10 steps each, the default job (vLLM on CPU)
python benchmarks/staleness.py --steps 10 --update-readme
python benchmarks/staleness.py --pg-override rollout.engine=hf
```

Each side is ``policygrad train`` (the default job: bundled model, arithmetic task, held-out
evaluation before and after) with ``--steps N --max_minutes=null`` and ``--rollout.max_staleness``
0 or 1, in its own process. Reported per side: median step time, generation time (the
producer's, for k = 1), the trainer's wait for rollouts (k = 0: all of generation), the share of
generation hidden behind training (``async/overlap``), the sampler/trainer gap and the behaviour
KL, held-out greedy accuracy before and after, and wall time. The first step is warm-up and left
out of the medians. Raw numbers go to ``benchmarks/results/<date>-staleness.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO_ROOT,
    fmt,
    machine_description,
    machine_line,
    markdown_table,
    median,
    new_result_path,
    today,
    update_readme_section,
    warn_if_busy,
    write_json,
)


def run_side(k: int, args, work: str) -> dict:
    out = os.path.join(work, f"k{k}")
    cmd = [sys.executable, "-m", "policygrad", "train", f"--steps={args.steps}", "--max_minutes=null"]
    cmd += [f"--output_dir={out}", "--progress=false", f"--rollout.max_staleness={k}", f"--seed={args.seed}"]
    cmd += [f"--{o}" for o in args.pg_override]
    if k:
        cmd += [f"--{o}" for o in args.k1_override]
    start = time.perf_counter()
    with open(os.path.join(work, f"k{k}.log"), "w", encoding="utf-8") as log:
        done = subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"error: the k={k} run failed (exit {done.returncode}); see {work}/k{k}.log")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    steps = [r for r in rows if "time/step_s" in r][1:]  # the first step is warm-up

    def med(key, default=None):
        values = [r[key] for r in steps if key in r]
        return median(values) if values else default

    generation = med("time/generation_s")
    return {
        "max_staleness": k,
        "steps": len(steps) + 1,
        "step_s_median": med("time/step_s"),
        "generation_s_median": generation,
        "generation_wait_s_median": med("time/generation_wait_s", generation),
        "training_s_median": med("time/training_s"),
        "weight_sync_s_median": med("time/weight_sync_s"),
        "overlap_median": med("async/overlap", 0.0),
        "staleness_by_step": [r.get("async/staleness", 0.0) for r in rows if "time/step_s" in r],
        "mismatch_logprob_abs_mean_median": med("mismatch/logprob_abs_mean"),
        "behaviour_kl_median": med("async/behaviour_kl"),
        "is_weight_mean_median": med("mismatch/is_weight_mean"),
        "reward_mean_by_step": [r["reward/mean"] for r in rows if "reward/mean" in r],
        "accuracy_before": summary.get("accuracy_before"),
        "accuracy_after": summary.get("accuracy_after"),
        "train_minutes": summary.get("train_minutes"),
        "wall_s": wall,
        "command": " ".join(cmd[1:]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="steps per side (the first is warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pg-override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--k1-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for the max_staleness=1 side only, e.g. num_threads=1 (one core each for "
        "generation and training)",
    )
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--update-readme", action="store_true")
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first is warm-up)")
    machine = machine_description()
    warn_if_busy(machine)
    work = tempfile.mkdtemp(prefix="policygrad-staleness-")
    sides = [run_side(k, args, work) for k in (0, 1)]
    result = {
        "date": today(),
        "machine": machine,
        "steps": args.steps,
        "overrides": args.pg_override,
        "k1_overrides": args.k1_override,
        "sides": sides,
    }
    path = args.output or new_result_path("staleness")
    write_json(path, result)
    header = ["max_staleness", "step (median)", "generation", "trainer waited", "overlap", "training"]
    header += ["accuracy before -> after", "wall"]
    rows = [
        [
            s["max_staleness"],
            f"{fmt(s['step_s_median'])} s",
            f"{fmt(s['generation_s_median'])} s",
            f"{fmt(s['generation_wait_s_median'])} s",
            fmt(s["overlap_median"]),
            f"{fmt(s['training_s_median'])} s",
            f"{fmt(s['accuracy_before'], 3)} -> {fmt(s['accuracy_after'], 3)}",
            f"{fmt(s['wall_s'] / 60, 1)} min",
        ]
        for s in sides
    ]
    table = markdown_table(header, rows)
    extra = f"; k = 1 side: {', '.join(args.k1_override)}" if args.k1_override else ""
    body = f"{table}\n\n{machine_line(machine)}; {args.steps} steps per side{extra}; `{path.name}`."
    print(body)
    if args.update_readme:
        update_readme_section("staleness", body)
    print(f"wrote {path}; run folders in {work} (delete when done)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
