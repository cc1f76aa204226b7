"""Time to a target accuracy: policygrad's default job against TRL's GRPOTrainer, the same
training minutes each, checkpoints about every minute, every checkpoint scored afterwards by one
evaluator, over several seeds per side.

Both sides train the bundled SmolLM2-135M-Instruct (float32 weights) on the built-in arithmetic
task with the settings of policygrad's default job (``policygrad train`` with no arguments): 4
prompts x G = 8 samples per step, at most 32 new tokens, temperature 1.0, AdamW at a constant
2e-5, gradient clipping at 1.0, beta = 0 (no reference model), reward = policygrad's
``answer_correctness``. Each side computes in its own default precision, as its users run it:
policygrad in ``model.precision: auto`` (bf16 autocast on CPUs with AVX512-BF16 or AMX, else
fp32), TRL in ``GRPOConfig``'s default (``bf16`` defaults to true in trl 1.16.0: bf16 autocast;
``--trl-override bf16=false`` gives fp32). The allocator is what the environment gives each (the
``policygrad`` command preloads tcmalloc when installed; set ``LD_PRELOAD`` to give TRL the same).
The report names both. The shared settings are read from the policygrad config, so a
``--pg-override`` of one of them (``kl.placement=loss kl.beta=0.04`` for beta) changes both sides.
TRL gets policygrad's train rows in policygrad's order as conversational prompts (its shuffling
off) and keeps its own defaults otherwise (gradient checkpointing, ``loss_type="dapo"``, and with
a beta the KL term weighted by pi/pi_old, ``use_bias_correction_kl``, which is policygrad's
``kl.importance_weighted``); ``--trl-override`` changes them. On the same batch and weights the
two libraries' gradients agree to 1e-5 when their options match, and over several steps their
optimizers, clips and schedules give the same weights (tests/trainer/test_same_batch_as_trl.py);
with matching options, curves that differ differ by their samples and by rounding (by default the
options differ as listed above).

Tasks (``--tasks``): ``builtin:arithmetic`` at difficulty ``hard`` (a + b, a - b or a * b with
a, b in 1..99; the start model scores 0.07 on its 200 held-out problems, room to rise over the
budget) as the main row, and ``medium`` (the default
job's task, a + b in 1..50, whose accuracy plateaus within a dozen steps) as the second.

Per task and seed, one side after the other (policygrad first on even seeds, TRL first on odd
ones): train for ``--minutes`` with a checkpoint about every ``--save-every`` minutes, then (off
the clock) score every checkpoint with ``policygrad eval`` (greedy, the task's first
``--eval-size`` held-out problems, at most the training's ``max_new_tokens``) and delete them.
The start model is scored once per task: the 0 s point of every curve. policygrad runs as
``python -m policygrad train`` (its ``max_minutes`` and ``save_every_minutes``; evaluation and
trackers off); TRL in a worker process with a callback that keeps the same clock. What
"training seconds" are, and the budget, are in ``benchmarks/_learning.py``'s docstring: the sum of
the steps' wall times, saves excluded, on both sides.

Reported per task: accuracy against training seconds (each checkpoint, medians over the seeds
with the range), and the training seconds each side needs to reach each target accuracy (the
first checkpoint at or above it; median over the seeds, a seed that never reaches it counted as
slower than any that did, and the range), with the ratio policygrad / TRL of the medians at every
target both reach; a second table the same with the target held (the first of ``HOLD`` = 2
consecutive checkpoints at or above it), since with a checkpoint every step or so a side with
faster steps gets more evaluations, each a chance of crossing a line by noise alone. Targets:
``--targets`` (accuracies), or by default 25, 50, 75 and 90 % of the way from the start accuracy
to the best any checkpoint reached.

Usage::

    python benchmarks/learn_vs_trl.py                        # hard and medium, 3 seeds, 10 min per side
    python benchmarks/learn_vs_trl.py --seeds 1 --minutes 1.5 --save-every 0.5 --eval-size 20 --tasks hard
    python benchmarks/learn_vs_trl.py --update-readme
    python benchmarks/learn_vs_trl.py --merge A.json B.json --output C.json   # seeds of two runs as one

``--merge`` joins finished results of the same measurement on other seeds (same settings, machine
and start accuracy, no seed twice; it refuses otherwise) into one, the targets and tables computed
again over all the seeds and each run's command and load averages kept; nothing is trained.

Writes ``benchmarks/results/<date>-learn-vs-trl-time-to-target.json`` (rewritten after every run,
so an interrupted measurement keeps what it finished); the run folders (model weights) go to a
temporary folder, each run's deleted once scored; the logs (training logs, each evaluation's log
and completions) to another one that stays (its path is printed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    Channel,
    Worker,
    add_common_options,
    log_dir,
    machine_description,
    machine_line,
    median,
    new_result_path,
    peak_rss_gb,
    policygrad_config,
    run_main,
    set_threads,
    today,
    update_readme_section,
    warn_if_busy,
    worker_env,
    write_json,
)
from _learning import (
    TrimCheckpoints,
    auto_targets,
    curve_table,
    merge_results,
    merged_line,
    parse_targets,
    parse_tasks,
    policygrad_points,
    side_line,
    target_rows,
    target_table,
    trl_checkpoints,
)
from grpo_vs_trl import (
    MODEL,
    expected_trl_precision,
    parse_trl_overrides,
    refuse_slow_trl_precision,
    trl_precision,
    trl_spec_from,
    trl_trainer,
)

README_SECTION = "learn-vs-trl"
RESULTS_NAME = "learn-vs-trl-time-to-target"
SIDES = ("policygrad", "trl")
HOLD = 2
"""The second time-to-target table's rule: a target counts as reached at a checkpoint only when
the next one is at or above it too (:func:`_learning.time_to_target`)."""


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def policygrad_base(args, *, task: str, minutes: float, seed: int, output_dir: str) -> dict[str, Any]:
    """The benchmark's settings on top of the default job: the task, the time limit, a step cap
    above what fits in it, a checkpoint every ``--save-every`` minutes, float32 frozen weights (the
    vLLM engine's), no evaluation or tracker during the run."""
    return {
        "steps": int(minutes * 60) + 10,  # no step takes under a second here
        "max_minutes": minutes,
        "seed": seed,
        "output_dir": output_dir,
        "eval_before": False,
        "eval_after": False,
        "eval_every": 0,
        "save_every": 0,
        "save_every_minutes": args.save_every,
        "keep_checkpoints": None,
        "log_completions": 0,
        "num_threads": args.threads,
        "tensorboard": False,
        "progress": False,
        "model": {"dtype": "float32"},
        "data": {"difficulty": task},
        "rollout": {"engine": args.pg_engine},
    }


def flat_overrides(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """``--a.b=VALUE`` command-line overrides of a nested dict (values as JSON, which YAML reads)."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += flat_overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"--{prefix}{key}={json.dumps(value)}")
    return out


# ----------------------------------------------------------------------------------------------
# The TRL worker: train for the time limit with checkpoints, report.


def serve_trl(spec: dict[str, Any]) -> None:
    """Worker: build TRL's GRPOTrainer, train until the time limit with the checkpoints of
    :func:`_learning.trl_checkpoints`, reply ``done`` with the steps, times and checkpoints."""
    chan = Channel.claim()
    try:
        t0 = time.perf_counter()
        threads = set_threads(int(spec["threads"]))
        trainer, config = trl_trainer(spec)
        record: dict[str, Any] = {
            "steps": 0,
            "wall_s": math.nan,
            "step_s": [],
            "checkpoints": [],
            "reward_mean": [],
        }
        trainer.add_callback(
            trl_checkpoints(
                trainer,
                record,
                budget_s=float(spec["seconds"]),
                save_every_s=float(spec["save_every_s"]),
                root=spec["checkpoint_dir"],
            )
        )
        load_s = time.perf_counter() - t0
        trainer.train()
        chan.send(
            {
                "ok": True,
                "event": "done",
                **record,
                "load_s": load_s,
                "threads": threads,
                "precision": trl_precision(config.bf16, config.fp16),
                "allocator": os.environ.get("LD_PRELOAD") or "glibc",
                "gradient_checkpointing": bool(config.gradient_checkpointing),
                "loss_type": str(config.loss_type),
                "optim": str(config.optim),
                "grpo_config": {k: str(v) for k, v in config.to_dict().items()},
                "peak_rss_gb": peak_rss_gb(),
            }
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator
        chan.fail(exc)
        raise SystemExit(1) from None
    while chan.recv().get("cmd") != "quit":
        pass
    chan.send({"ok": True, "event": "bye"})


# ----------------------------------------------------------------------------------------------
# The coordinator: one training run of a side, the evaluations.


def run_logged(cmd: list[str], log: Path, *, threads: int, timeout: float) -> str:
    """Run ``cmd`` from the repository root with the benchmark environment, stderr to ``log``;
    returns its stdout (also appended to the log). Raises SystemExit naming the log on failure."""
    with open(log, "w", encoding="utf-8") as err:
        err.write("$ " + " ".join(cmd) + "\n")
        err.flush()
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=worker_env(threads), stdout=subprocess.PIPE, stderr=err, text=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise SystemExit(f"error: {cmd[3]} took over {timeout:.0f} s; see {log}") from None
        err.write(out)
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(cmd[2:4])} failed (exit {proc.returncode}); see {log}")
    return out


def train_policygrad(args, task: str, minutes: float, seed: int, scratch: Path, logs: Path) -> dict[str, Any]:
    """``policygrad train`` for the time limit; its steps, times and checkpoints."""
    run_dir = scratch / "policygrad-run"
    base = policygrad_base(args, task=task, minutes=minutes, seed=seed, output_dir=str(run_dir))
    cmd = [sys.executable, "-m", "policygrad", "train", *flat_overrides(base)]
    cmd += [o if o.startswith("--") else f"--{o}" for o in args.pg_override]
    log = logs / f"{task}-seed{seed}-policygrad-train.log"
    say(f"[{task} seed {seed}] policygrad: training for {minutes:g} min (log {log})")
    start = time.perf_counter()
    with TrimCheckpoints(run_dir) as trim:
        run_logged(cmd, log, threads=args.threads, timeout=minutes * 60 + 3600)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    step_s, checkpoints = policygrad_points(run_dir)
    return {
        "command": " ".join(["python", *cmd[1:]]),
        "steps": summary["steps"],
        "wall_s": summary["train_minutes"] * 60,
        "stopped_by_time": summary.get("stopped_by_max_minutes"),
        "engine": summary.get("rollout_engine"),
        "step_s": step_s,
        "checkpoints": checkpoints,
        "process_wall_s": time.perf_counter() - start,
        "peak_rss_gb": summary.get("peak_rss_gb"),
        "optimizer_state_deleted_gb": trim.freed_gb,
    }


def train_trl(args, cfg, task: str, minutes: float, seed: int, scratch: Path, logs: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer for the time limit in a worker process; its steps, times and checkpoints."""
    spec = trl_spec_from(
        cfg,
        beta=cfg.kl.beta if cfg.kl.placement != "none" else 0.0,
        steps_total=int(minutes * 60) + 10,
        threads=args.threads,
        output_dir=str(scratch / "trl-run"),
        trl_overrides=parse_trl_overrides(args.trl_override),
    )
    spec.update(
        {
            "seconds": minutes * 60,
            "save_every_s": args.save_every * 60,
            "checkpoint_dir": str(scratch / "trl-checkpoints"),
        }
    )
    path = scratch / "trl-spec.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    log = logs / f"{task}-seed{seed}-trl-train.log"
    say(f"[{task} seed {seed}] TRL: training for {minutes:g} min (log {log})")
    worker = Worker(
        [sys.executable, str(Path(__file__).resolve()), "--worker", "--spec", str(path)],
        name="TRL worker",
        log_path=log,
        threads=args.threads,
    )
    try:
        done = worker.receive(args.load_timeout + minutes * 60 + args.step_timeout)
    finally:
        worker.close()
    done["peak_rss_tree_gb"] = worker.tree_rss_peak_gb
    return done


def evaluate(args, task: str, name: str, model: str, max_new_tokens: int, logs: Path) -> dict[str, Any]:
    """``policygrad eval`` of ``model`` (greedy, the task's first ``--eval-size`` held-out problems)."""
    cmd = [sys.executable, "-m", "policygrad", "eval", "--model", model, "--dataset", "builtin:arithmetic"]
    cmd += ["--difficulty", task, "--limit", str(args.eval_size), "--max-new-tokens", str(max_new_tokens)]
    cmd += ["--engine", args.eval_engine, "--num-threads", str(args.threads), "--seed", "0"]
    cmd += ["--output", str(logs / f"eval-{task}-{name}.jsonl")]
    out = run_logged(cmd, logs / f"eval-{task}-{name}.log", threads=args.threads, timeout=3600)
    start = out.rfind("\n{")
    result = json.loads(out[start + 1 :] if start >= 0 else out)
    return {k: result.get(k) for k in ("accuracy", "n", "engine", "seconds", "load_seconds")}


def score_run(
    args, task: str, side: str, seed: int, run: dict[str, Any], max_new_tokens: int, logs: Path
) -> None:
    """Score every checkpoint of one run (in place: ``accuracy`` and ``eval`` of each)."""
    for point in run["checkpoints"]:
        name = f"seed{seed}-{side}-step{point['step']}"
        point["eval"] = evaluate(args, task, name, point["model_dir"], max_new_tokens, logs)
        point["accuracy"] = point["eval"]["accuracy"]
        say(
            f"[{task} seed {seed}] {side} step {point['step']} ({point['train_s']:.0f} training s): "
            f"accuracy {point['accuracy']:.3f}"
        )


def finish_run(run: dict[str, Any]) -> None:
    """Add the derived numbers of one run: training seconds, seconds per step, time outside steps."""
    run["train_s"] = sum(run["step_s"])
    run["seconds_per_step"] = median(run["step_s"])
    run["outside_steps_s"] = run["wall_s"] - run["train_s"] if run.get("wall_s") is not None else None
    for point in run["checkpoints"]:
        point.pop("model_dir", None)  # deleted with the run folder


# ----------------------------------------------------------------------------------------------
# Summaries and the report.


def summarise_task(entry: dict[str, Any], targets: list[float] | None, eval_size: int) -> None:
    """Each side's curves and the time-to-target rows of one task (in place)."""
    start = entry["start"]["accuracy"]
    curves = {
        side: [[(0.0, start)] + [(p["train_s"], p.get("accuracy")) for p in r["checkpoints"]] for r in runs]
        for side, runs in entry["runs"].items()
    }
    best = max((a for side in curves.values() for c in side for _, a in c if a is not None), default=start)
    entry["best_accuracy"] = best
    entry["targets"] = targets if targets is not None else auto_targets(start, best, 1 / eval_size)
    entry["time_to_target"] = target_rows(curves, entry["targets"])
    entry["hold"] = HOLD
    entry["time_to_target_held"] = target_rows(curves, entry["targets"], HOLD)


def report(result: dict[str, Any]) -> str:
    """The markdown block printed at the end and written into the README section."""
    m, s = result["machine"], result["settings"]
    load = m.get("loadavg_at_start") or [math.nan]
    threads = f"{s['threads']} thread{'s' if s['threads'] != 1 else ''} per side"
    if result.get("merged_from"):
        first = (
            f"Joined {result['date']} with `{result['command']}` from {len(result['merged_from'])} runs "
            f"on {machine_line(m)}, {threads}: {merged_line(result)}."
        )
    else:
        first = (
            f"Measured {result['date']} with `{result['command']}` on {machine_line(m)}; {threads}; "
            f"load average {load[0]:.2f} at the start"
            + (f", {m['loadavg_at_end'][0]:.2f} at the end" if m.get("loadavg_at_end") else "")
            + f"; {result['wall_minutes']:.0f} min in all."
        )
    lines = [first, ""]
    for task, entry in result["tasks"].items():
        if "time_to_target" not in entry:
            continue
        start = entry["start"]["accuracy"]
        if entry["targets"]:
            lines += [target_table(task, start, entry["time_to_target"], s["seeds"]), ""]
            if "time_to_target_held" in entry:  # absent from results saved before it existed
                held = entry["time_to_target_held"]
                lines += [target_table(task, start, held, s["seeds"], entry["hold"]), ""]
        else:
            lines += [f"{task}: no target: no checkpoint scored above the start model's {start:.3f}.", ""]
        lines += [curve_table(task, start, entry["runs"]), ""]
        lines += [
            f"{task}, {entry['minutes']:g} min per side: "
            + "; ".join(
                side_line("policygrad" if side == "policygrad" else "TRL", runs)
                for side, runs in entry["runs"].items()
            )
            + ".",
            "",
        ]
    beta = f"beta {s['beta']:g}" + (f" ({s['kl_placement']})" if s["beta"] else "")
    # the rule the saved result's held rows were computed with (none before they existed)
    hold = next((e["hold"] for e in result["tasks"].values() if "time_to_target_held" in e), None)
    pg_engine, eval_engine = (
        s.get("pg_engine_used") or s["pg_engine"],
        s.get("eval_engine_used") or s["eval_engine"],
    )
    lines.append(
        f"builtin:arithmetic; {s['prompts_per_step']} prompts x G = {s['group_size']} per step, at most "
        f"{s['max_new_tokens']} new tokens, temperature {s['temperature']:g}, lr {s['lr']:g} constant, "
        f"{beta}, float32 weights, reward `answer_correctness`. Compute and allocator: policygrad "
        f"{s['pg_precision']}, {_lib(s['pg_allocator'])} ({pg_engine} engine"
        + (f", loss aggregation `{s['pg_agg_mode']}`" if s.get("pg_agg_mode") else "")
        + "); TRL "
        f"{s['trl_precision']}, {_lib(s['trl_allocator'])}, its defaults otherwise (`loss_type="
        f"{s.get('trl_loss_type')}`, gradient checkpointing {s.get('trl_gradient_checkpointing')}). "
        f"Training seconds: the steps' wall times summed (saves and loading excluded, both sides); "
        f"each side trains until {s['minutes_note']} of wall time since its first step (saves included) "
        f"and checkpoints about every {s['save_every']:g} min; seeds {s['seed_list']}, one side after the "
        f"other. Accuracy: `policygrad eval`, greedy, the task's first {s['eval_size']} held-out problems "
        f"({eval_engine} engine). Time to target: the first checkpoint at or above it; median over "
        "the seeds [fastest-slowest], a seed that never reached it counted as slower than any that did."
        + (
            f" Held {hold} checkpoints: the first of {hold} consecutive checkpoints at or above the "
            "target (a crossing too near a side's last checkpoint cannot be held and counts as not "
            "reached), so one lucky evaluation does not decide it."
            if hold
            else ""
        )
    )
    return "\n".join(lines)


def _lib(path: str | None) -> str:
    """``/usr/lib/.../libtcmalloc_minimal.so.4`` -> ``tcmalloc_minimal``."""
    return os.path.basename(path or "glibc").split(".so")[0].removeprefix("lib")


def settings(args, cfg, tasks: list[tuple[str, float]], seeds: list[int]) -> dict[str, Any]:
    r = cfg.rollout
    beta = cfg.kl.beta if cfg.kl.placement != "none" else 0.0
    import torch  # imported here: the policygrad precision resolves on torch's device

    from policygrad.allocator import plan_preload
    from policygrad.parallel.precision import resolve_precision

    inherited = os.environ.get("LD_PRELOAD") or None
    return {
        # policygrad's precision and allocator as its command resolves them on this machine; TRL's
        # as its GRPOConfig resolves --trl-override (the workers' replies replace it) and the
        # environment it inherits
        "pg_precision": resolve_precision(
            cfg.model.precision, torch.device("cpu"), model_dtype=cfg.model.dtype
        ).name,
        "pg_allocator": inherited or plan_preload(os.environ, sys.platform) or "glibc",
        "trl_precision": expected_trl_precision(parse_trl_overrides(args.trl_override)),
        "trl_allocator": inherited or "glibc",
        # the loss aggregation: the preset's unless --pg-override sets loss.agg_mode
        "pg_agg_mode": cfg.agg_mode,
        "model": cfg.model.name,
        "tasks": dict(tasks),
        "minutes_note": ", ".join(f"{m:g} min ({t})" for t, m in tasks),
        "save_every": args.save_every,
        "seeds": len(seeds),
        "seed_list": seeds,
        "eval_size": args.eval_size,
        "eval_engine": args.eval_engine,
        "targets": args.targets,
        "threads": args.threads,
        "pg_engine": args.pg_engine,
        "pg_overrides": args.pg_override,
        "trl_overrides": args.trl_override,
        "prompts_per_step": r.prompts_per_step,
        "group_size": r.group_size,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "lr": cfg.optim.lr,
        "beta": beta,
        "kl_placement": cfg.kl.placement,
        "training_seconds": "the sum of the steps' wall times up to a checkpoint (saves, loading excluded)",
        "budget": "a side starts a step while under the task's minutes of wall time since its first step",
    }


def run(args, out: Path) -> dict[str, Any]:
    machine = machine_description()
    warn_if_busy(machine)
    tasks = parse_tasks(args.tasks, args.minutes)
    seeds = [args.seed + i for i in range(args.seeds)]
    targets = parse_targets(args.targets)
    logs = log_dir("learn-vs-trl")
    say(f"logs: {logs}")
    configs = {}
    for task, minutes in tasks:  # validates the overrides before anything runs
        base = policygrad_base(args, task=task, minutes=minutes, seed=args.seed, output_dir=str(logs / "x"))
        configs[task] = policygrad_config(base, args.pg_override)
        if configs[task].data.dataset != "builtin:arithmetic":
            raise SystemExit("error: the evaluation is on builtin:arithmetic; keep data.dataset")
    cfg = configs[tasks[0][0]]
    result: dict[str, Any] = {
        "benchmark": "learn_vs_trl",
        "date": today(),
        # the preload the coordinator inherited decides TRL's allocator, so it is part of the command
        "command": " ".join(
            [*([f"LD_PRELOAD={os.environ['LD_PRELOAD']}"] if os.environ.get("LD_PRELOAD") else []), "python"]
            + ["benchmarks/learn_vs_trl.py", *sys.argv[1:]]
        ),
        "machine": machine,
        "settings": settings(args, cfg, tasks, seeds),
        "logs": str(logs),
        "complete": False,
        "tasks": {},
    }
    started = time.perf_counter()
    max_new = cfg.rollout.max_new_tokens
    for task, minutes in tasks:
        say(f"[{task}] scoring the start model")
        entry = result["tasks"][task] = {
            "minutes": minutes,
            "start": evaluate(args, task, "start", MODEL, max_new, logs),
            "runs": {side: [] for side in SIDES},
        }
        result["settings"]["eval_engine_used"] = entry["start"].get("engine")
        for seed in seeds:
            seed_cfg = policygrad_config(
                policygrad_base(args, task=task, minutes=minutes, seed=seed, output_dir=str(logs / "x")),
                args.pg_override,
            )
            for side in SIDES if seed % 2 == 0 else SIDES[::-1]:
                scratch = Path(tempfile.mkdtemp(prefix=f"pg-bench-learn-{task}-{side}-"))
                try:
                    if side == "policygrad":
                        one = train_policygrad(args, task, minutes, seed, scratch, logs)
                    else:
                        one = train_trl(args, seed_cfg, task, minutes, seed, scratch, logs)
                        result["settings"].update(
                            trl_precision=one["precision"],
                            trl_allocator=one["allocator"],
                            trl_loss_type=one["loss_type"],
                            trl_gradient_checkpointing="on" if one["gradient_checkpointing"] else "off",
                        )
                    one["seed"] = seed
                    score_run(args, task, side, seed, one, max_new, logs)
                    if side == "policygrad":
                        result["settings"]["pg_engine_used"] = one.get("engine")
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
                finish_run(one)
                entry["runs"][side].append(one)
                result["wall_minutes"] = (time.perf_counter() - started) / 60
                write_json(out, result)  # what is finished survives an interruption
        summarise_task(entry, targets, args.eval_size)
        write_json(out, result)
    result["wall_minutes"] = (time.perf_counter() - started) / 60
    try:
        machine["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    result["complete"] = True
    return result


def merge(args) -> int:
    """``--merge``: one result from finished results on other seeds (see ``merge_results``)."""
    parts = []
    for path in args.merge:
        try:
            parts.append((path.name, json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --merge {path}: cannot read it as a result ({e})") from None
    try:
        result = merge_results(parts)
    except ValueError as e:
        raise SystemExit(f"error: --merge: {e}") from None
    result["date"] = today()
    result["command"] = " ".join(["python", "benchmarks/learn_vs_trl.py", *sys.argv[1:]])
    targets = parse_targets(args.targets)
    eval_size = result["settings"]["eval_size"]
    result["settings"]["targets"] = args.targets
    for entry in result["tasks"].values():
        summarise_task(entry, targets, eval_size)
    out = args.output or new_result_path(RESULTS_NAME)
    write_json(out, result)
    publish(args, result, f"wrote {out}")
    return 0


def publish(args, result: dict[str, Any], wrote: str) -> None:
    """Print the report, say where the result went, and with --update-readme put it in the README."""
    text = report(result)
    print(text)
    say(wrote)
    if args.update_readme:
        update_readme_section(args.readme_section, text)
        say(f"updated the '{args.readme_section}' section of benchmarks/README.md")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="training minutes per side and seed (default 10)"
    )
    parser.add_argument(
        "--tasks",
        default="hard,medium",
        help="builtin:arithmetic difficulties, the main one first, each NAME or NAME:MINUTES "
        "(default hard,medium)",
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="seeds per side and task: --seed, --seed+1, ... (default 3)"
    )
    parser.add_argument(
        "--save-every",
        type=float,
        default=1.0,
        help="a checkpoint after the step that ends this many minutes after the last save (default 1)",
    )
    parser.add_argument(
        "--targets",
        default=None,
        help="comma-separated target accuracies (default: 25/50/75/90 %% of the way from the start "
        "accuracy to the best reached)",
    )
    parser.add_argument(
        "--eval-size", type=int, default=200, help="held-out problems evaluated (default 200)"
    )
    parser.add_argument(
        "--eval-engine", default="auto", choices=("hf", "vllm", "auto"), help="policygrad eval's --engine"
    )
    add_common_options(parser, RESULTS_NAME)
    parser.set_defaults(threads=2)
    parser.add_argument(
        "--trl-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra GRPOConfig field (repeatable), e.g. gradient_checkpointing=false; bf16=false for "
        "TRL in fp32 (default: GRPOConfig's bf16 autocast)",
    )
    parser.add_argument(
        "--readme-section",
        default=README_SECTION,
        help=f"the benchmarks/README.md section --update-readme rewrites (default {README_SECTION}; "
        "another name keeps a variant's table beside the main one)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="RESULT",
        help="join finished results of the same measurement on other seeds into one (--output), "
        "the targets and tables computed again over all the seeds; nothing is trained",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve_trl(json.loads(args.spec.read_text(encoding="utf-8")))
        return 0
    if args.merge:
        return merge(args)
    if args.minutes <= 0 or args.eval_size < 1 or args.threads < 1 or args.seeds < 1 or args.save_every <= 0:
        parser.error("--minutes and --save-every must be > 0, --eval-size, --threads and --seeds >= 1")
    if importlib.util.find_spec("trl") is None:
        parser.error('TRL is not installed: pip install -e ".[bench]" (trl 1.16.0)')
    refuse_slow_trl_precision(parser, args.trl_override)
    out = args.output or new_result_path(RESULTS_NAME)
    result = run(args, out)
    write_json(out, result)
    publish(args, result, f"wrote {out} ({result['wall_minutes']:.1f} min); logs in {result['logs']}")
    return 0


if __name__ == "__main__":
    run_main(main)
