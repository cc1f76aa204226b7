"""The memory planner against measurement: for each configuration, ``policygrad memory --config``'s
planned peak of the trainer process beside the peak resident set size a real run of it reaches.

Every run samples every response to full length (``rollout.ignore_eos=true``) and forwards every
row, those whose advantages are all 0 too (``optim.skip_zero_advantage_rows=false``), which is
what the plan prices, trains 3 steps without evaluations, and is measured by ``wait4``'s ``ru_maxrss`` of
the trainer process (its whole life: start, steps, final checkpoint). Runs go one at a time.

    python benchmarks/memory_check.py                       # every configuration
    python benchmarks/memory_check.py --only default,lora   # some of them
    python benchmarks/memory_check.py --update-readme       # and rewrite benchmarks/README.md's table
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    machine_description,
    machine_line,
    markdown_table,
    new_result_path,
    run_main,
    update_readme_section,
    write_json,
)

COMMON = [
    "--steps=3",
    "--eval_before=false",
    "--eval_after=false",
    "--rollout.ignore_eos=true",
    "--optim.skip_zero_advantage_rows=false",
    "--progress=false",
]

CONFIGURATIONS: dict[str, list[str]] = {
    "default job (vllm, micro-batch 32)": [],
    "hf engine": ["--rollout.engine=hf"],
    "micro-batch 4": ["--optim.micro_batch_size=4"],
    "micro-batch 8": ["--optim.micro_batch_size=8"],
    "vLLM KV cache 2 GiB": ["--rollout.vllm_kv_cache_gb=2"],
    "LoRA r=16": ["--model.lora.rank=16"],
    "PPO with a critic": ["--algorithm=ppo"],
    "KL to a reference (beta 0.04)": ["--kl.beta=0.04", "--kl.placement=loss"],
    "long context (256 new tokens)": ["--rollout.max_new_tokens=256"],
    "long context, hf, micro-batch 8": [
        "--rollout.engine=hf",
        "--rollout.max_new_tokens=256",
        "--optim.micro_batch_size=8",
    ],
    "long context, gradient checkpointing": [
        "--rollout.max_new_tokens=256",
        "--model.gradient_checkpointing=true",
    ],
}


def planned(overrides: list[str]) -> dict:
    """The plan of one configuration, in this process (no model loads)."""
    from policygrad.config.train import load_config
    from policygrad.parallel.before_loading import plan_run_from_config

    cfg = load_config(None, list(overrides))
    return plan_run_from_config(cfg).to_dict()


def measured(overrides: list[str], scratch: str) -> dict:
    """Run the configuration; the trainer's peak RSS (GB) from ``wait4``, and the run's seconds."""
    cmd = [
        sys.executable,
        "-m",
        "policygrad",
        "train",
        *overrides,
        f"--output_dir={scratch}",
        "--overwrite=true",
    ]
    start = time.perf_counter()
    with open(os.path.join(scratch + ".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    got = {"peak_rss_gb": usage.ru_maxrss * 1024 / 1e9, "seconds": time.perf_counter() - start}
    code = os.waitstatus_to_exitcode(status)
    steps = 0
    if os.path.exists(os.path.join(scratch, "metrics.jsonl")):
        with open(os.path.join(scratch, "metrics.jsonl"), encoding="utf-8") as f:
            steps = sum(1 for line in f if line.strip())
    if code != 0:
        with open(scratch + ".log", encoding="utf-8", errors="replace") as log:
            got["exit"] = f"{shlex.join(cmd)} exited {code} after {steps} logged steps: " + log.read()[-1500:]
        # a run that sampled and updated its steps and then failed its end-of-run health check
        # (every reward 0 at full length: nothing trained) still reached its peak: measured
        if steps < 3:
            return {"error": got["exit"]}
    return got


def table(rows: list[dict]) -> str:
    return markdown_table(
        ["configuration", "planned peak (GB)", "measured peak RSS (GB)", "planned / measured"],
        [[r["name"], f"{r['planned_gb']:.2f}", f"{r['measured_gb']:.2f}", f"{r['ratio']:.3f}"] for r in rows],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated configuration names (substrings)")
    parser.add_argument(
        "--output", default=None, help="the JSON to write (default: results/<date>-memory-check.json)"
    )
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args()
    chosen = CONFIGURATIONS
    if args.only:
        keys = [k.strip() for k in args.only.split(",")]
        chosen = {n: o for n, o in CONFIGURATIONS.items() if any(k in n for k in keys)}
    machine = machine_description()
    load = (machine.get("loadavg_at_start") or [float("nan")])[0]
    rows = []
    out = Path(args.output) if args.output else new_result_path("memory-check")
    command = shlex.join([sys.executable, *sys.argv])
    with tempfile.TemporaryDirectory(prefix="pg-memory-check-") as tmp:
        for i, (name, overrides) in enumerate(chosen.items()):
            plan = planned(COMMON + overrides)
            got = measured(COMMON + overrides, os.path.join(tmp, f"run{i}"))
            row = {"name": name, "overrides": overrides, "planned_gb": plan["peak_gb"], "plan": plan, **got}
            if "error" in got:
                print(f"{name}: {got['error'][-600:]}", flush=True)
            else:
                row.update(measured_gb=got["peak_rss_gb"], ratio=plan["peak_gb"] / got["peak_rss_gb"])
                print(
                    f"{name}: planned {row['planned_gb']:.2f} GB, measured {row['measured_gb']:.2f} GB "
                    f"({row['ratio']:.3f})",
                    flush=True,
                )
            rows.append(row)
            # written after every run: an interrupted check keeps what it measured
            write_json(
                out, {"command": command, "machine": machine, "load_average_at_start": load, "rows": rows}
            )
    done = [r for r in rows if "ratio" in r]
    worst = max((abs(r["ratio"] - 1) for r in done), default=float("nan"))
    text = (
        f"Measured {time.strftime('%Y-%m-%d')} with `{' '.join(['python', *sys.argv])}` "
        f"on {machine_line(machine)}; "
        f"load average {load:.2f} at start; each run `policygrad train {' '.join(COMMON)}` plus its options "
        "(the policygrad command preloads tcmalloc where the machine has it). "
        f"Largest error: {100 * worst:.1f} %.\n\n"
        + table(done)
        + "".join(f"\n\n{r['name']}: the run failed (see the JSON)." for r in rows if "error" in r)
        + "".join(
            f"\n\n{r['name']}: every step ran, then the run ended with an error (its last lines are in "
            "the JSON), so its peak is measured."
            for r in done
            if "exit" in r
        )
    )
    print(text)
    write_json(
        out,
        {
            "command": command,
            "machine": machine,
            "load_average_at_start": load,
            "rows": rows,
            "worst_error": worst,
        },
    )
    print(f"wrote {out}")
    if args.update_readme:
        update_readme_section("memory-check", text)
    return 0


if __name__ == "__main__":
    run_main(main)
