"""Entropy collapse and its remedies on the default job: the policy's entropy, step by step, with
the default loss and with Clip-Cov (Cui et al. 2025), trained side by side.

```bash
python benchmarks/entropy.py                            # default vs clip_cov (paper's 2e-4) vs clip_cov 2e-2
python benchmarks/entropy.py --minutes 10 --variant kl_cov=loss.policy_loss=kl_cov
python benchmarks/entropy.py --collect default=runs/a clip_cov=runs/b   # summarise finished runs
```

Each variant is ``policygrad train`` (the default job: bundled model, arithmetic task, held-out
evaluation before and after) with ``--max_minutes M --num_threads=1`` plus the variant's overrides,
all variants running at the same time, so each gets one core of a 2-core machine under the same
conditions. Reported per variant: ``entropy/mean`` (the policy's mean token entropy before each
update), ``entropy/cov`` (the covariance of log-prob and advantage that lowers it),
``entropy/cov_selected_frac``, reward and held-out greedy accuracy before and after, and steps.
Raw numbers go to ``benchmarks/results/<date>-entropy.json``. Checkpoints are not kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    REPO_ROOT,
    fmt,
    machine_description,
    machine_line,
    markdown_table,
    new_result_path,
    today,
    warn_if_busy,
    write_json,
)

DEFAULT_VARIANTS = (
    "default=",
    "clip_cov=loss.policy_loss=clip_cov",
    "clip_cov_2e-2=loss.policy_loss=clip_cov,loss.options.clip_cov_ratio=0.02",
)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME=KEY=VALUE,KEY=VALUE`` -> (NAME, ["KEY=VALUE", ...])."""
    name, _, overrides = text.partition("=")
    if not name:
        raise SystemExit(f"error: --variant {text!r} needs a name: NAME=KEY=VALUE,... (or NAME= for none)")
    return name, [o for o in overrides.split(",") if o]


def summarise(name: str, run_dir: str, command: str | None = None) -> dict:
    """A finished run's entropy trajectory and outcome."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    steps = [r for r in rows if "entropy/mean" in r]

    def series(key):
        return [r.get(key) for r in steps]

    return {
        "variant": name,
        "steps": len(steps),
        "entropy_mean_by_step": series("entropy/mean"),
        "entropy_cov_by_step": series("entropy/cov"),
        "cov_selected_frac_by_step": series("entropy/cov_selected_frac"),
        "reward_mean_by_step": series("reward/mean"),
        "accuracy_before": summary.get("accuracy_before"),
        "accuracy_after": summary.get("accuracy_after"),
        "train_minutes": summary.get("train_minutes"),
        "command": command,
    }


def run_variants(variants: list[tuple[str, list[str]]], args, work: str) -> list[dict]:
    procs = []
    for name, overrides in variants:
        out = os.path.join(work, name)
        cmd = [
            sys.executable,
            "-m",
            "policygrad",
            "train",
            f"--max_minutes={args.minutes}",
            "--num_threads=1",
        ]
        cmd += [f"--output_dir={out}", "--progress=false", f"--seed={args.seed}", "--save_every_minutes=0"]
        cmd += [f"--{o}" for o in overrides]
        log = open(os.path.join(work, f"{name}.log"), "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        procs.append(
            (name, out, cmd, log, subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT))
        )
    results = []
    for name, out, cmd, log, proc in procs:
        code = proc.wait()
        log.close()
        if code:
            raise SystemExit(f"error: the {name} run failed (exit {code}); see {work}/{name}.log")
        shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
        results.append(summarise(name, out, " ".join(cmd[1:])))
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="training minutes per variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...")
    p.add_argument(
        "--collect", nargs="+", default=None, metavar="NAME=RUN_DIR", help="summarise finished runs"
    )
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    machine = machine_description()
    if args.collect:
        variants = [text.partition("=")[::2] for text in args.collect]
        results = [summarise(name, run_dir) for name, run_dir in variants]
    else:
        warn_if_busy(machine)
        work = tempfile.mkdtemp(prefix="policygrad-entropy-")
        results = run_variants([parse_variant(v) for v in args.variant or DEFAULT_VARIANTS], args, work)
        print(f"run folders in {work} (delete when done)", file=sys.stderr)
    path = args.output or new_result_path("entropy")
    write_json(path, {"date": today(), "machine": machine, "minutes": args.minutes, "variants": results})
    header = ["variant", "steps", "entropy at step 0, 5, 10, 15, 20, last", "accuracy before -> after"]
    rows = []
    for r in results:
        e = r["entropy_mean_by_step"]
        marks = [fmt(e[i]) if i < len(e) else "-" for i in (0, 5, 10, 15, 20)] + [fmt(e[-1]) if e else "-"]
        rows.append(
            [
                r["variant"],
                r["steps"],
                ", ".join(marks),
                f"{fmt(r['accuracy_before'], 3)} -> {fmt(r['accuracy_after'], 3)}",
            ]
        )
    print(markdown_table(header, rows))
    print(f"\n{machine_line(machine)}; `{path.name}`.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
