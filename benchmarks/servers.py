"""The default job with generation on a rollout server apart from the trainer, against the
in-process vLLM engine, one after the other on this machine.

```bash
python benchmarks/servers.py                      # 8 steps per side
python benchmarks/servers.py --steps 10 --trainer-cpus 0 --server-cpus 1
```

Sides (each ``policygrad train`` in its own process, the default job with ``--steps N
--max_minutes=null --data.eval_size=0``, no evaluation):

- ``in-process``: today's default, the vLLM engine in the trainer's process, every CPU;
- ``server k=0``: the trainer on ``--trainer-cpus`` (its process affinity, ``num_threads`` = their
  count), one server the run starts on ``--server-cpus`` (``rollout.servers=1``,
  ``rollout.server_cpus``), synchronous;
- ``server k=1``: the same with ``rollout.max_staleness=1`` (the server samples step m+1 while
  the trainer trains step m).

Reported per side (medians of steps 2..N; the first is warm-up): step time, generation (the
producer's time for the batch), the trainer's wait for rollouts (k = 0: all of generation), the
server's idle share (1 - generation / step, summed over the measured steps: the server works only
while a batch is produced), weight push, response tokens per second of the step, and wall time.
Raw numbers go to ``benchmarks/results/<date>-servers.json``.
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
    warn_if_busy,
    write_json,
)


def cpu_list(text: str) -> list[int]:
    cpus = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus += list(range(int(low), int(high or low) + 1))
    return cpus


def run_side(name: str, extra: list[str], trainer_cpus: list[int] | None, args, work: str) -> dict:
    out = os.path.join(work, name.replace(" ", "-").replace("=", ""))
    cmd = [sys.executable, "-m", "policygrad", "train", f"--steps={args.steps}", "--max_minutes=null"]
    cmd += [f"--output_dir={out}", "--progress=false", f"--seed={args.seed}", "--data.eval_size=0"]
    cmd += ["--eval_before=false", "--eval_after=false", *extra]
    start = time.perf_counter()
    with open(out + ".log", "w", encoding="utf-8") as log:
        done = subprocess.run(
            cmd,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
            preexec_fn=(lambda: os.sched_setaffinity(0, trainer_cpus)) if trainer_cpus else None,
        )
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"error: the {name} run failed (exit {done.returncode}); see {out}.log")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "time/step_s" in r][1:]  # the first step is warm-up

    def med(key, default=None):
        values = [r[key] for r in steps if key in r]
        return median(values) if values else default

    generation = med("time/generation_s")
    busy = sum(r.get("time/generation_s", 0.0) for r in steps)
    return {
        "side": name,
        "overrides": extra,
        "trainer_cpus": trainer_cpus,
        "steps": len(steps) + 1,
        "step_s_median": med("time/step_s"),
        "generation_s_median": generation,
        "generation_wait_s_median": med("time/generation_wait_s", generation),
        "training_s_median": med("time/training_s"),
        "weight_sync_s_median": med("time/weight_sync_s"),
        "server_idle_share": 1.0 - busy / sum(r["time/step_s"] for r in steps),
        "tokens_per_s_median": med("perf/tokens_per_s"),
        "reward_mean_by_step": [r.get("reward/mean") for r in rows if "time/step_s" in r],
        "wall_s": wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="steps per side (the first is warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainer-cpus", default="0", help="the server sides' trainer CPUs")
    p.add_argument("--server-cpus", default="1", help="the server's CPUs")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first is warm-up)")
    machine = machine_description()
    warn_if_busy(machine)
    work = tempfile.mkdtemp(prefix="policygrad-servers-")
    trainer = cpu_list(args.trainer_cpus)
    server = [
        "--rollout.engine=server",
        "--rollout.servers=1",
        f'--rollout.server_cpus=["{args.server_cpus}"]',
    ]
    server += [f"--num_threads={len(trainer)}"]
    sides = [
        run_side("in-process", ["--rollout.engine=vllm"], None, args, work),
        run_side("server k=0", server, trainer, args, work),
        run_side("server k=1", [*server, "--rollout.max_staleness=1"], trainer, args, work),
    ]
    result = {"date": today(), "machine": machine, "steps": args.steps, "sides": sides}
    path = args.output or new_result_path("servers")
    write_json(path, result)
    header = ["side", "step (median)", "generation", "trainer waited", "training", "weight push"]
    header += ["server idle", "tokens/s", "wall"]
    rows = [
        [
            s["side"],
            f"{fmt(s['step_s_median'])} s",
            f"{fmt(s['generation_s_median'])} s",
            f"{fmt(s['generation_wait_s_median'])} s",
            f"{fmt(s['training_s_median'])} s",
            f"{fmt(s['weight_sync_s_median'])} s",
            fmt(s["server_idle_share"]),
            fmt(s["tokens_per_s_median"], 1),
            f"{fmt(s['wall_s'] / 60, 1)} min",
        ]
        for s in sides
    ]
    table = markdown_table(header, rows)
    print(f"{table}\n\n{machine_line(machine)}; {args.steps} steps per side; `{path.name}`.")
    print(f"wrote {path}; run folders in {work} (delete when done)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
