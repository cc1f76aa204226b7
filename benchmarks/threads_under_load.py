"""A policygrad step beside another CPU-bound job: a fixed thread count against the adaptive one.

```bash
python benchmarks/threads_under_load.py                      # 2 rounds, 1 warm-up + 3 steps per side
python benchmarks/threads_under_load.py --rounds 3 --steps 5 --update-readme
python benchmarks/threads_under_load.py --load matmul --load-jobs 1 --threads 2
python benchmarks/threads_under_load.py --rounds 1 --steps 1 --warmup 0   # the smallest check
```

A second job runs for the whole measurement: ``--load-jobs`` processes (default 1), each a busy
Python loop (``--load spin``, one core) or one-thread torch matmuls (``--load matmul``). Beside
it, the two sides take turns, one worker process at a time (the other side's worker is not
alive, so it cannot count as load): ``num_threads`` fixed at ``--threads`` (default: every
CPU, torch's default), and ``num_threads`` null (the trainer fits its count to the load at start
and before each step). Each side's worker builds the run (the bundled model, a small GRPO
config as in ``grpo_vs_trl.py``, ``rollout.engine`` vllm), runs ``--warmup`` steps that are not
timed, then ``--steps`` timed steps; ``--rounds`` times, the sides alternating. Reported per side:
the median step, generation and training times, and the thread counts the steps used
(``perf/threads``). Raw numbers go to ``benchmarks/results/<date>-threads-under-load.json``.
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
    Worker,
    add_common_options,
    as_float,
    fmt,
    log_dir,
    machine_description,
    machine_line,
    markdown_table,
    median,
    new_result_path,
    run_main,
    serve_policygrad,
    today,
    update_readme_section,
    write_json,
)
from grpo_vs_trl import policygrad_settings  # noqa: E402

LOADS = {
    # one core each: a pure-Python loop, or torch matmuls on one thread
    "spin": "while True:\n    pass\n",
    "matmul": (
        "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\n"
        "while True:\n    a = torch.tanh(a @ a)\n"
    ),
}


def start_load(kind: str, jobs: int) -> list[subprocess.Popen]:
    """``jobs`` CPU-bound processes of ``kind`` (each stopped by :func:`stop_load`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return [
        subprocess.Popen([sys.executable, "-c", LOADS[kind]], env=env, stdout=subprocess.DEVNULL)
        for _ in range(jobs)
    ]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_turn(side: str, num_threads: int | None, round_: int, args, logs: Path, work: str) -> dict:
    """One worker of ``side``: build, ``--warmup`` untimed steps, ``--steps`` timed steps."""
    settings = policygrad_settings(
        beta=0.0,
        seed=args.seed,
        engine=args.pg_engine,
        threads=num_threads,
        steps=args.warmup + args.steps,
        output_dir=os.path.join(work, f"{side}-{round_}"),
    )
    spec = {"threads": args.threads, "config": settings, "overrides": args.pg_override}
    spec_path = logs / f"{side}-{round_}-spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    worker = Worker(
        [sys.executable, str(Path(__file__).resolve()), "--spec", str(spec_path)],
        name=f"{side} (round {round_})",
        log_path=logs / f"{side}-{round_}.log",
        threads=args.threads,
    )
    try:
        ready = worker.receive(args.load_timeout)
        steps = []
        for k in range(args.warmup + args.steps):
            reply = worker.request({"cmd": "step"}, args.step_timeout)
            m = reply["metrics"]
            row = {
                "step_s": as_float(reply["wall_s"]),
                "generation_s": as_float(m.get("time/generation_s")),
                "training_s": as_float(m.get("time/training_s")),
                "threads": as_float(m.get("perf/threads", reply.get("threads"))),
                "response_tokens": reply.get("response_tokens"),
                "warmup": k < args.warmup,
            }
            steps.append(row)
            print(
                f"  {side} round {round_} step {k}{' (warm-up)' if row['warmup'] else ''}: "
                f"{fmt(row['step_s'])} s, {int(row['threads'])} threads",
                file=sys.stderr,
                flush=True,
            )
    finally:
        worker.close()
    return {
        "side": side,
        "round": round_,
        "load_s": ready.get("load_s"),
        "engine": ready.get("engine"),
        "steps": steps,
    }


def summarise(turns: list[dict], side: str) -> dict:
    timed = [s for t in turns if t["side"] == side for s in t["steps"] if not s["warmup"]]

    def med(key):
        return median(s[key] for s in timed) if timed else None

    return {
        "side": side,
        "steps": len(timed),
        "step_s_median": med("step_s"),
        "generation_s_median": med("generation_s"),
        "training_s_median": med("training_s"),
        "threads": sorted({int(s["threads"]) for s in timed}),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_options(p, "threads-under-load")
    p.set_defaults(pg_engine="vllm")
    p.add_argument("--rounds", type=int, default=2, help="turns per side, alternating (default 2)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per turn (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of a turn (default 1)")
    p.add_argument("--load", default="spin", choices=sorted(LOADS), help="the other job (default spin)")
    p.add_argument("--load-jobs", type=int, default=1, help="processes of the other job (default 1)")
    args = p.parse_args()
    if args.spec is not None:  # a worker
        serve_policygrad(json.loads(args.spec.read_text(encoding="utf-8")))
        return 0
    for flag, value, least in (
        ("--rounds", args.rounds, 1),
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
        ("--load-jobs", args.load_jobs, 0),
        ("--threads", args.threads, 1),
    ):
        if value < least:
            p.error(f"{flag} must be >= {least}, got {value}")
    machine = machine_description()  # before the load starts: the load average of the machine itself
    logs, work = log_dir("threads"), tempfile.mkdtemp(prefix="policygrad-threads-")
    sides = ((f"num_threads={args.threads}", args.threads), ("adaptive (null)", None))
    load = start_load(args.load, args.load_jobs)
    turns = []
    start = time.perf_counter()
    try:
        time.sleep(2.0)  # the load is running before the first worker reads the machine
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side, n in order:
                turns.append(run_turn(side, n, r, args, logs, work))
    finally:
        stop_load(load)
    summary = [summarise(turns, side) for side, _ in sides]
    result = {
        "date": today(),
        "machine": machine,
        "load": {"kind": args.load, "jobs": args.load_jobs},
        "rounds": args.rounds,
        "steps_per_turn": args.steps,
        "warmup_per_turn": args.warmup,
        "engine": args.pg_engine,
        "overrides": args.pg_override,
        "wall_s": time.perf_counter() - start,
        "sides": summary,
        "turns": turns,
    }
    path = args.output or new_result_path("threads-under-load")
    write_json(path, result)
    header = ["threads", "step (median)", "generation", "training", "threads used", "steps"]
    rows = [
        [
            s["side"],
            f"{fmt(s['step_s_median'])} s",
            f"{fmt(s['generation_s_median'])} s",
            f"{fmt(s['training_s_median'])} s",
            ", ".join(str(t) for t in s["threads"]),
            s["steps"],
        ]
        for s in summary
    ]
    body = (
        f"{markdown_table(header, rows)}\n\n{machine_line(machine)}; beside {args.load_jobs} `{args.load}` "
        f"job(s); {args.rounds} rounds of {args.warmup} warm-up + {args.steps} timed steps per side, "
        f"alternating; rollout.engine {args.pg_engine}; `{path.name}`."
    )
    print(body)
    if args.update_readme:
        update_readme_section("threads-under-load", body)
    print(f"wrote {path}; worker logs in {logs}; run folders in {work} (delete when done)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)
