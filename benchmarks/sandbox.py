"""The code sandbox's cost: per-call overhead and the throughput of the ``code_tests`` reward.

Two numbers, on the isolation the machine gives by default (``--isolation auto``) or a chosen one:

* per-call overhead: ``Sandbox.run_tests`` of a trivial correct program (``add(a, b)``, one
  assert), called one after another ``--calls`` times; median and 90th percentile in ms. This is
  the price of the design: two fresh interpreters, each in its own namespaces (or bwrap), the
  pipes between them and the kill at the end. ``Sandbox.run`` (one interpreter, no tests) is
  measured the same way for comparison.
* batch throughput: the ``code_tests`` reward on a batch of ``--batch`` completions (the reference
  answers of ``builtin:code:hard`` held-out problems, 5 asserts each) with ``workers`` programs at
  a time for each value of ``--workers``; rewards/s = batch / wall seconds, median of
  ``--rounds`` batches.

Usage::

    python benchmarks/sandbox.py                          # auto isolation, workers 1,2,4,8
    python benchmarks/sandbox.py --isolation namespaces --update-readme
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

from _common import (
    machine_description,
    machine_line,
    markdown_table,
    new_result_path,
    today,
    update_readme_section,
    warn_if_busy,
    write_json,
)

from policygrad.data.code_task import CodeTask
from policygrad.rewards.code import CodeTests
from policygrad.sandbox.runner import Sandbox, TestSpec

CORRECT = "def add(a, b):\n    return a + b\n"
SPEC = TestSpec(names=("add",), asserts=("assert add(2, 3) == 5",))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def per_call(sandbox: Sandbox, calls: int) -> dict:
    """Sequential run_tests and run calls: median / p90 milliseconds."""
    tests, runs = [], []
    for _ in range(calls):
        start = time.perf_counter()
        result = sandbox.run_tests(CORRECT, SPEC)
        tests.append((time.perf_counter() - start) * 1000)
        if not result.all_passed:
            raise RuntimeError(f"the correct program failed in the sandbox: {result}")
        start = time.perf_counter()
        sandbox.run("pass")
        runs.append((time.perf_counter() - start) * 1000)
    return {
        "run_tests_ms_median": statistics.median(tests),
        "run_tests_ms_p90": _percentile(tests, 0.9),
        "run_ms_median": statistics.median(runs),
        "run_ms_p90": _percentile(runs, 0.9),
        "calls": calls,
    }


def throughput(isolation: str, workers: int, batch: int, rounds: int) -> dict:
    """Rewards per second of code_tests on a batch of reference answers."""
    rows = CodeTask("hard").heldout_rows(batch)
    reward = CodeTests(isolation=isolation, workers=workers)
    fields = {"tests": [r["tests"] for r in rows], "entry_point": [r["entry_point"] for r in rows]}
    completions = [f"```python\n{r['answer']}```" for r in rows]
    prompts = [r["prompt"] for r in rows]
    seconds = []
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            scores = reward(prompts, completions, **fields)
            seconds.append(time.perf_counter() - start)
            if scores != [1.0] * batch:
                raise RuntimeError(f"reference answers failed: {scores}")
    finally:
        reward.close()
    wall = statistics.median(seconds)
    return {"workers": workers, "batch": batch, "seconds_median": wall, "rewards_per_s": batch / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isolation", default="auto", choices=("auto", "bwrap", "namespaces", "none"))
    parser.add_argument("--calls", type=int, default=30, help="sequential calls for the overhead")
    parser.add_argument("--batch", type=int, default=32, help="completions per reward call (default 32)")
    parser.add_argument("--workers", default="1,2,4,8", help="comma-separated pool sizes (default 1,2,4,8)")
    parser.add_argument("--rounds", type=int, default=3, help="batches per pool size (default 3)")
    parser.add_argument("--output", type=Path, default=None, help="JSON (results/<date>-sandbox-<mode>.json)")
    parser.add_argument("--update-readme", action="store_true", help="rewrite the mode's README section")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    machine = machine_description()
    warn_if_busy(machine)
    sandbox = Sandbox(args.isolation)
    sandbox.run_tests(CORRECT, SPEC)  # warm-up: the page cache holds the interpreter afterwards
    overhead = per_call(sandbox, args.calls)
    pools = [throughput(args.isolation, int(w), args.batch, args.rounds) for w in args.workers.split(",")]
    result = {
        "date": today(),
        "isolation": sandbox.description,
        "machine": machine,
        "per_call": overhead,
        "batch": pools,
        "settings": vars(args) | {"output": str(args.output) if args.output else None},
    }
    path = args.output or new_result_path(f"sandbox-{sandbox.isolation}")
    write_json(path, result)
    load = machine.get("loadavg_at_start")
    load_text = f"{load[0]:.1f}" if load else "unknown"
    caption = (
        f"Measured {today()} with `python benchmarks/sandbox.py --isolation {args.isolation}` on "
        f"{machine_line(machine)}; isolation {sandbox.description}; load average at start {load_text} "
        "(other jobs shared the CPUs when it is above the core count)."
    )
    table1 = markdown_table(
        ["call", "median ms", "p90 ms"],
        [
            ["`run_tests` (2 sandboxes, 1 assert)", f"{overhead['run_tests_ms_median']:.0f}",
             f"{overhead['run_tests_ms_p90']:.0f}"],
            ["`run` (1 sandbox)", f"{overhead['run_ms_median']:.0f}", f"{overhead['run_ms_p90']:.0f}"],
        ],
    )
    table2 = markdown_table(
        ["workers", f"batch of {args.batch}: seconds", "rewards/s"],
        [[p["workers"], f"{p['seconds_median']:.2f}", f"{p['rewards_per_s']:.1f}"] for p in pools],
    )
    body = f"{caption}\n\n{table1}\n\n{table2}\n\nRaw numbers: `benchmarks/results/{path.name}`."
    print(body)
    if args.update_readme:
        update_readme_section(f"sandbox-{sandbox.isolation}", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
