"""Learning per minute: policygrad's default job against TRL's GRPOTrainer, the same training wall
time each, one after the other on the same machine, both final models scored by one evaluator.

Both sides train the bundled SmolLM2-135M-Instruct (float32 weights) on the built-in arithmetic task
with the settings of policygrad's default job (``policygrad train`` with no arguments): 4 prompts
x G = 8 samples per step, at most 32 new tokens, temperature 1.0, AdamW at a constant 2e-5,
gradient clipping at 1.0, beta = 0 (no reference model), reward = policygrad's
``answer_correctness``. policygrad computes in its default precision on this machine
(``model.precision: auto``: bf16 autocast on CPUs with AVX512-BF16 or AMX, else fp32), TRL in
fp32 unless ``--trl-override bf16=true`` (its own default); the allocator is what the
environment gives each (the ``policygrad`` command preloads tcmalloc when installed; set
``LD_PRELOAD`` to give TRL the same). The report says which each side ran with.
The shared settings are read from the policygrad config, so a ``--pg-override`` of one
of them (``kl.placement=loss kl.beta=0.04`` for beta) changes both sides. TRL gets policygrad's
train rows in policygrad's order as conversational prompts (its shuffling off) and keeps its own
defaults otherwise (gradient checkpointing, ``loss_type="dapo"``); ``--trl-override`` changes
them.

Training wall time is counted the same way on both sides, from the start of the first step; a
side starts another step while less than ``--minutes`` have passed (policygrad: ``max_minutes``,
checked before each step; TRL: a callback that stops training after the step that passes the
limit). Model loading, the final save and the evaluations are outside it. policygrad runs as
``python -m policygrad train`` (evaluation, periodic checkpoints and trackers off; its final
checkpoint is the model evaluated); TRL in a worker process that saves its final model with
``trainer.save_model``.

Then ``policygrad eval`` (greedy, the same ``--eval-size`` held-out problems, at most the
training's ``max_new_tokens``, as the in-run evaluation of ``policygrad train``) scores the start
model, policygrad's final model and TRL's. Reported: accuracy before and after, the gain of each
side, the gain ratio (policygrad / TRL), steps, seconds per step.

Usage::

    python benchmarks/learn_vs_trl.py                        # 10 minutes per side
    python benchmarks/learn_vs_trl.py --minutes 1 --eval-size 20   # a quick check of the script
    python benchmarks/learn_vs_trl.py --update-readme

Writes ``benchmarks/results/<date>-learn-vs-trl.json``; the run folders (model weights) go to a
temporary folder deleted at the end, the logs to another one that stays (its path is printed).
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
    fmt,
    log_dir,
    machine_description,
    machine_line,
    markdown_table,
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
from grpo_vs_trl import MODEL, parse_trl_overrides, trl_spec_from, trl_trainer

README_SECTION = "learn-vs-trl"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def policygrad_base(*, minutes: float, max_steps: int, seed: int, engine: str, threads: int, output_dir: str):
    """The benchmark's settings on top of the default job: the time limit, a step cap above what
    fits in it, float32 frozen weights (the vLLM engine's), no evaluation, checkpoint or tracker
    during the run (nothing but steps inside the time limit)."""
    return {
        "steps": max_steps,
        "max_minutes": minutes,
        "seed": seed,
        "output_dir": output_dir,
        "eval_before": False,
        "eval_after": False,
        "eval_every": 0,
        "save_every": 0,
        "save_every_minutes": 0,
        "log_completions": 0,
        "num_threads": threads,
        "tensorboard": False,
        "progress": False,
        "model": {"dtype": "float32"},
        "rollout": {"engine": engine},
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
# The TRL worker: train for the time limit, save, report.


def _time_limit(seconds: float, record: dict[str, Any]):
    """A callback that stops TRL's training after the first step that ends past ``seconds`` from
    the start of the first step, recording each step's wall time and TRL's logged metrics."""
    from transformers import TrainerCallback

    class TimeLimit(TrainerCallback):
        def __init__(self):
            self.start: float | None = None
            self.step_start = 0.0

        def on_step_begin(self, _args, _state, _control, **_kw):
            self.step_start = time.perf_counter()
            if self.start is None:
                self.start = self.step_start

        def on_step_end(self, _args, state, control, **_kw):
            now = time.perf_counter()
            record["step_s"].append(now - self.step_start)
            record["steps"] = state.global_step
            record["train_s"] = now - self.start
            if now - self.start > seconds:
                control.should_training_stop = True

        def on_log(self, _args, _state, _control, logs=None, **_kw):
            if logs:
                record["logs"].append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    return TimeLimit()


def serve_trl(spec: dict[str, Any]) -> None:
    """Worker: build TRL's GRPOTrainer, train until the time limit, save the final model and its
    tokenizer to ``spec["final_dir"]``, reply ``done`` with the steps, times and logs."""
    chan = Channel.claim()
    try:
        t0 = time.perf_counter()
        threads = set_threads(int(spec["threads"]))
        trainer, config = trl_trainer(spec)
        record: dict[str, Any] = {"steps": 0, "train_s": math.nan, "step_s": [], "logs": []}
        trainer.add_callback(_time_limit(float(spec["seconds"]), record))
        load_s = time.perf_counter() - t0
        trainer.train()
        t1 = time.perf_counter()
        trainer.save_model(spec["final_dir"])
        trainer.processing_class.save_pretrained(spec["final_dir"])
        chan.send(
            {
                "ok": True,
                "event": "done",
                **record,
                "load_s": load_s,
                "save_s": time.perf_counter() - t1,
                "threads": threads,
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
# The coordinator.


def run_logged(cmd: list[str], log: Path, *, threads: int, timeout: float) -> str:
    """Run ``cmd`` from the repository root with the benchmark environment, stderr to ``log``;
    returns its stdout (also appended to the log). Raises SystemExit naming the log on failure."""
    with open(log, "w", encoding="utf-8") as err:
        err.write("$ " + " ".join(cmd) + "\n")
        err.flush()
        try:
            done = subprocess.run(
                cmd,
                cwd=REPO_ROOT,
                env=worker_env(threads),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise SystemExit(f"error: {cmd[3]} took over {timeout:.0f} s; see {log}") from None
        err.write(done.stdout)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(cmd[2:4])} failed (exit {done.returncode}); see {log}")
    return done.stdout


def train_policygrad(args, cfg_overrides: list[str], run_dir: Path, logs: Path) -> dict[str, Any]:
    """``policygrad train`` for the time limit; its steps, times and final model folder."""
    cmd = [sys.executable, "-m", "policygrad", "train", *cfg_overrides]
    say(f"[policygrad] training for {args.minutes:g} min (log {logs / 'policygrad-train.log'})")
    start = time.perf_counter()
    run_logged(cmd, logs / "policygrad-train.log", threads=args.threads, timeout=args.minutes * 60 + 3600)
    wall = time.perf_counter() - start
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if "time/step_s" in r]
    return {
        "command": " ".join(["python", *cmd[1:]]),
        "steps": summary["steps"],
        "train_s": summary["train_minutes"] * 60,
        "stopped_by_time": summary.get("stopped_by_max_minutes"),
        "engine": summary.get("rollout_engine"),
        "step_s": [r["time/step_s"] for r in steps],
        "reward_mean": [r.get("reward/mean") for r in steps],
        "response_length_mean": [r.get("response/length_mean") for r in steps],
        "process_wall_s": wall,
        "peak_rss_gb": summary.get("peak_rss_gb"),
        "model_dir": str(run_dir / "checkpoints" / f"step_{summary['steps']}" / "model"),
    }


def train_trl(args, spec: dict[str, Any], scratch: Path, logs: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer for the time limit in a worker process; its steps, times and model."""
    path = scratch / "trl-spec.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    say(f"[trl] training for {args.minutes:g} min (log {logs / 'trl-train.log'})")
    worker = Worker(
        [sys.executable, str(Path(__file__).resolve()), "--worker", "--spec", str(path)],
        name="TRL worker",
        log_path=logs / "trl-train.log",
        threads=args.threads,
    )
    try:
        done = worker.receive(args.load_timeout + args.minutes * 60 + args.step_timeout)
    finally:
        worker.close()
    done.update(
        {
            "model_dir": spec["final_dir"],
            "reward_mean": [log.get("reward") for log in done.get("logs", []) if "reward" in log],
            "peak_rss_tree_gb": worker.tree_rss_peak_gb,
        }
    )
    return done


def evaluate(name: str, model: str, args, max_new_tokens: int, logs: Path) -> dict[str, Any]:
    """``policygrad eval`` of ``model`` (greedy, the first ``--eval-size`` held-out problems)."""
    cmd = [sys.executable, "-m", "policygrad", "eval", "--model", model, "--dataset", "builtin:arithmetic"]
    cmd += [
        "--limit",
        str(args.eval_size),
        "--max-new-tokens",
        str(max_new_tokens),
        "--engine",
        args.pg_engine,
    ]
    cmd += [
        "--num-threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        "--output",
        str(logs / f"eval-{name}.jsonl"),
    ]
    say(f"[eval] {name}")
    out = run_logged(cmd, logs / f"eval-{name}.log", threads=args.threads, timeout=3600)
    start = out.rfind("\n{")
    result = json.loads(out[start + 1 :] if start >= 0 else out)
    result["command"] = " ".join(["python", *cmd[1:]])
    return result


def _gain_ratio(pg_gain: float, trl_gain: float) -> float:
    """policygrad's gain / TRL's; NaN unless TRL gained (a ratio to a loss or to 0 means nothing)."""
    return pg_gain / trl_gain if trl_gain > 0 else math.nan


def summarise(result: dict[str, Any]) -> None:
    """Add each side's gain and step statistics, and the ratios, to ``result``."""
    before = result["eval"]["before"]["accuracy"]
    for side in ("policygrad", "trl"):
        s = result["sides"][side]
        s["accuracy_after"] = result["eval"][side]["accuracy"]
        s["accuracy_gain"] = s["accuracy_after"] - before
        s["seconds_per_step"] = s["train_s"] / s["steps"] if s["steps"] else math.nan
        s["step_s_median"] = median(s["step_s"])
    pg, trl = result["sides"]["policygrad"], result["sides"]["trl"]
    result["accuracy_before"] = before
    result["gain_ratio"] = _gain_ratio(pg["accuracy_gain"], trl["accuracy_gain"])
    result["steps_ratio"] = pg["steps"] / trl["steps"] if trl["steps"] else math.nan


def _lib(path: str | None) -> str:
    """``/usr/lib/.../libtcmalloc_minimal.so.4`` -> ``tcmalloc_minimal``."""
    return os.path.basename(path or "glibc").split(".so")[0].removeprefix("lib")


def report(result: dict[str, Any]) -> str:
    """The markdown block printed at the end and written into the README section."""
    m, s = result["machine"], result["settings"]
    pg, trl = result["sides"]["policygrad"], result["sides"]["trl"]
    gc = "on" if trl.get("gradient_checkpointing") else "off"
    header = [
        "",
        f"policygrad ({pg.get('engine')})",
        f"TRL {m['packages'].get('trl')} (grad. ckpt {gc})",
        "policygrad / TRL",
    ]
    before = fmt(result["accuracy_before"], 3)

    def ratio(a, b, digits=2):
        return fmt(a / b, digits) if b and math.isfinite(a) and math.isfinite(b) else "-"

    rows = [
        ["accuracy before", before, before, ""],
        ["accuracy after", fmt(pg["accuracy_after"], 3), fmt(trl["accuracy_after"], 3), ""],
        [
            "**accuracy gain**",
            f"**{pg['accuracy_gain']:+.3f}**",
            f"**{trl['accuracy_gain']:+.3f}**",
            f"**{fmt(result['gain_ratio'])}**",
        ],
        ["steps", pg["steps"], trl["steps"], ratio(pg["steps"], trl["steps"])],
        ["training time (min)", fmt(pg["train_s"] / 60), fmt(trl["train_s"] / 60), ""],
        [
            "seconds per step (mean)",
            fmt(pg["seconds_per_step"]),
            fmt(trl["seconds_per_step"]),
            ratio(pg["seconds_per_step"], trl["seconds_per_step"]),
        ],
        [
            "seconds per step (median)",
            fmt(pg["step_s_median"]),
            fmt(trl["step_s_median"]),
            ratio(pg["step_s_median"], trl["step_s_median"]),
        ],
    ]
    load = m.get("loadavg_at_start") or [math.nan]
    load_end = m.get("loadavg_at_end") or [math.nan]
    beta = f"beta {s['beta']:g}" + (f" ({s['kl_placement']}, {s['kl_kind']})" if s["beta"] else "")
    return "\n".join(
        [
            f"Measured {result['date']} with `{result['command']}` on {machine_line(m)}; "
            f"{s['threads']} threads per side; load average {fmt(load[0])} at the start, "
            f"{fmt(load_end[0])} at the end.",
            "",
            markdown_table(header, rows),
            "",
            f"{s['minutes']:g} min of training per side, one side after the other; {s['prompts_per_step']} "
            f"prompts x G = {s['group_size']} per step, at most {s['max_new_tokens']} new tokens, "
            f"temperature {s['temperature']:g}, lr {s['lr']:g} constant, {beta}, float32 weights; compute "
            f"and allocator: policygrad {s.get('pg_precision', '?')}, {_lib(s.get('pg_allocator'))}; TRL "
            f"{s.get('trl_precision', '?')}, {_lib(s.get('trl_allocator'))}; reward "
            "`answer_correctness`; TRL with its defaults otherwise "
            f"(`loss_type={trl.get('loss_type')}`). Accuracy: `policygrad eval`, greedy, the same "
            f"{s['eval_size']} held-out problems, at most {s['max_new_tokens']} new tokens. "
            "Gain ratio = policygrad's gain / TRL's (blank unless TRL gained).",
        ]
    )


def settings(args, cfg) -> dict[str, Any]:
    r = cfg.rollout
    beta = cfg.kl.beta if cfg.kl.placement != "none" else 0.0
    import torch

    from policygrad.allocator import plan_preload
    from policygrad.parallel.precision import resolve_precision

    inherited = os.environ.get("LD_PRELOAD") or None
    return {
        # what each side computes in and allocates with: policygrad as its command resolves them on
        # this machine, TRL as its GRPOConfig (bf16=False unless --trl-override bf16=true) and the
        # environment it inherits
        "pg_precision": resolve_precision(
            cfg.model.precision, torch.device("cpu"), model_dtype=cfg.model.dtype
        ).name,
        "pg_allocator": inherited or plan_preload(os.environ, sys.platform) or "glibc",
        "trl_precision": "bf16 (autocast)" if parse_trl_overrides(args.trl_override).get("bf16") else "fp32",
        "trl_allocator": inherited or "glibc",
        "model": cfg.model.name,
        "dataset": cfg.data.dataset,
        "minutes": args.minutes,
        "eval_size": args.eval_size,
        "seed": args.seed,
        "threads": args.threads,
        "pg_engine": args.pg_engine,
        "pg_overrides": args.pg_override,
        "trl_overrides": args.trl_override,
        "prompts_per_step": r.prompts_per_step,
        "group_size": r.group_size,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "lr": cfg.optim.lr,
        "lr_schedule": cfg.optim.schedule,
        "beta": beta,
        "kl_placement": cfg.kl.placement,
        "kl_kind": cfg.kl.resolved_kind() if beta else None,
        "training_time": "wall time from the start of the first step; a step starts while under --minutes",
    }


def run(args) -> dict[str, Any]:
    machine = machine_description()
    warn_if_busy(machine)
    logs = log_dir("learn-vs-trl")
    scratch = Path(tempfile.mkdtemp(prefix="pg-bench-learn-vs-trl-runs-"))
    say(f"logs: {logs}; run folders (deleted at the end): {scratch}")
    # a step cap far above what fits in the time limit (no step takes under a second here)
    max_steps = int(args.minutes * 60) + 10
    base = policygrad_base(
        minutes=args.minutes,
        max_steps=max_steps,
        seed=args.seed,
        engine=args.pg_engine,
        threads=args.threads,
        output_dir=str(scratch / "policygrad-run"),
    )
    cfg = policygrad_config(base, args.pg_override)  # validates the overrides before anything runs
    if cfg.data.dataset != "builtin:arithmetic":
        raise SystemExit("error: the evaluation is on builtin:arithmetic; keep data.dataset")
    s = settings(args, cfg)
    spec = trl_spec_from(
        cfg,
        beta=s["beta"],
        steps_total=max_steps,
        threads=args.threads,
        output_dir=str(scratch / "trl-run"),
        trl_overrides=parse_trl_overrides(args.trl_override),
    )
    spec.update({"seconds": args.minutes * 60, "final_dir": str(scratch / "trl-final")})
    pg_cmd = flat_overrides(base) + [o if o.startswith("--") else f"--{o}" for o in args.pg_override]
    result: dict[str, Any] = {
        "benchmark": "learn_vs_trl",
        "date": today(),
        # the preload the coordinator inherited decides TRL's allocator, so it is part of the command
        "command": " ".join(
            [*([f"LD_PRELOAD={os.environ['LD_PRELOAD']}"] if os.environ.get("LD_PRELOAD") else []), "python"]
            + ["benchmarks/learn_vs_trl.py", *sys.argv[1:]]
        ),
        "machine": machine,
        "settings": s,
        "logs": str(logs),
        "sides": {},
        "eval": {},
    }
    started = time.perf_counter()
    try:
        result["sides"]["policygrad"] = train_policygrad(args, pg_cmd, scratch / "policygrad-run", logs)
        result["sides"]["trl"] = train_trl(args, spec, scratch, logs)
        models = {"before": MODEL, **{k: v["model_dir"] for k, v in result["sides"].items()}}
        for name, model in models.items():
            result["eval"][name] = evaluate(name, model, args, s["max_new_tokens"], logs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["wall_minutes"] = (time.perf_counter() - started) / 60
    try:
        machine["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    summarise(result)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="training wall time per side (default 10)"
    )
    parser.add_argument(
        "--eval-size", type=int, default=200, help="held-out problems evaluated (default 200)"
    )
    add_common_options(parser, "learn-vs-trl")
    parser.set_defaults(threads=2)
    parser.add_argument(
        "--trl-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra GRPOConfig field (repeatable), e.g. gradient_checkpointing=false",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve_trl(json.loads(args.spec.read_text(encoding="utf-8")))
        return 0
    if args.minutes <= 0 or args.eval_size < 1 or args.threads < 1:
        parser.error("--minutes must be > 0, --eval-size >= 1, --threads >= 1")
    if importlib.util.find_spec("trl") is None:
        parser.error('TRL is not installed: pip install -e ".[bench]" (trl 1.16.0)')
    result = run(args)
    out = args.output or new_result_path("learn-vs-trl", result["date"])
    write_json(out, result)
    text = report(result)
    print(text)
    say(f"wrote {out} ({result['wall_minutes']:.1f} min); logs in {result['logs']}")
    if args.update_readme:
        update_readme_section(README_SECTION, text)
        say(f"updated the '{README_SECTION}' section of benchmarks/README.md")
    return 0


if __name__ == "__main__":
    run_main(main)
