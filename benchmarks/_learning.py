"""Pieces of ``learn_vs_trl.py``: the training clock and checkpoints of each side, time to a
target accuracy over seeds, and the report's tables.

The clock, the same on both sides:

- **training seconds** of a checkpoint = the sum of the wall times of the steps up to and
  including its step (policygrad: the trainer's ``time/step_s``, around ``Trainer.step()``: the
  rollout, the update and the weight sync; TRL: ``on_step_begin`` to ``on_step_end``: its
  generation, loss, backward and optimizer step). Model loading, checkpoint saves and the
  bookkeeping between steps are not in it. This is the x-axis of every curve and the time to a
  target.
- **the budget**: a side starts another step while less than ``--minutes`` of wall time have
  passed since the start of its training (policygrad's ``max_minutes``, checked before each step;
  TRL: a callback that stops after the step past the limit). This wall time does include the
  checkpoint saves on both sides (policygrad's ``max_minutes`` counts them, and the script cannot
  change that without changing ``policygrad train``), so a side that saves more slowly gets fewer
  training seconds in the same budget; the report gives each side's training seconds reached and
  its time outside the steps.
- **checkpoints**: after a step that ends ``--save-every`` minutes or more of wall time after the
  end of the previous save (or the start of training), and after the last step (policygrad's
  ``save_every_minutes`` rule; TRL: the same rule in the callback, saving the policy with
  ``trainer.save_model`` and the tokenizer with ``save_pretrained``).
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import fmt, markdown_table

TARGET_FRACTIONS = (0.25, 0.5, 0.75, 0.9)
"""Default targets: these fractions of the way from the start accuracy to the best reached."""


# ----------------------------------------------------------------------------------------------
# Options.


def parse_tasks(text: str, minutes: float) -> list[tuple[str, float]]:
    """``"hard,medium:5"`` -> ``[("hard", minutes), ("medium", 5.0)]``: the built-in arithmetic
    difficulties to run, each with its training minutes per side (``--minutes`` unless given)."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, sep, raw = item.partition(":")
        try:
            budget = float(raw) if sep else float(minutes)
        except ValueError:
            raise SystemExit(f"--tasks: {item!r} is not NAME or NAME:MINUTES") from None
        if name not in ("easy", "medium", "hard") or budget <= 0:
            raise SystemExit(f"--tasks: {item!r}: NAME is easy, medium or hard, MINUTES > 0")
        out.append((name, budget))
    if not out:
        raise SystemExit("--tasks names no task")
    return out


def parse_targets(text: str | None) -> list[float] | None:
    """``"0.2,0.3"`` -> ``[0.2, 0.3]``; None (automatic targets) for None or ``auto``."""
    if text is None or text.strip() in ("", "auto"):
        return None
    try:
        values = sorted({float(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise SystemExit(f"--targets must be comma-separated accuracies, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise SystemExit("--targets must be accuracies in (0, 1]")
    return values


# ----------------------------------------------------------------------------------------------
# The TRL side's clock and checkpoints (runs in the TRL worker).


class TrlClock:
    """The clock of the module docstring on the TRL side: each step's wall time in
    ``record["step_s"]``, a checkpoint (``save(step)``) after a step that ends ``save_every_s`` or
    more after the previous save's end (or the first step's start), and a stop after the step that
    ends past ``budget_s`` of wall time since the first step began (the last step is then saved
    too). Each checkpoint goes into ``record["checkpoints"]`` with its step, training seconds,
    wall seconds and save seconds. ``clock`` is the time source (``time.perf_counter``)."""

    def __init__(self, save, record: dict[str, Any], *, budget_s: float, save_every_s: float, clock=None):
        self._save, self.record = save, record
        self.budget_s, self.save_every_s = budget_s, save_every_s
        self.clock = clock or time.perf_counter
        self.first: float | None = None
        self.step_start = self.last_save = self.train_s = 0.0
        record.setdefault("step_s", [])
        record.setdefault("checkpoints", [])

    def save(self, step: int, wall: float) -> None:
        start = self.clock()
        path = self._save(step)
        self.last_save = self.clock()
        point = {"step": step, "train_s": self.train_s, "wall_s": wall, "save_s": self.last_save - start}
        self.record["checkpoints"].append({**point, "model_dir": path})

    def step_begin(self) -> None:
        self.step_start = self.clock()
        if self.first is None:
            self.first = self.last_save = self.step_start

    def step_end(self, step: int) -> bool:
        """Account for the step just ended; True when training should stop."""
        end = self.clock()
        self.record["step_s"].append(end - self.step_start)
        self.train_s += end - self.step_start
        self.record["steps"] = step
        if end - self.last_save >= self.save_every_s:
            self.save(step, end - self.first)
        now = self.clock()
        self.record["wall_s"] = now - self.first
        if now - self.first <= self.budget_s:
            return False
        self.save_last(step)
        return True

    def save_last(self, step: int) -> None:
        """Save ``step`` unless it was just saved (the end of training)."""
        done = self.record["checkpoints"]
        if self.first is not None and step and not (done and done[-1]["step"] == step):
            self.save(step, self.record["wall_s"])


def trl_checkpoints(trainer, record: dict[str, Any], *, budget_s: float, save_every_s: float, root: str):
    """A TrainerCallback that keeps :class:`TrlClock` for ``trainer``, saving the policy
    (``trainer.save_model``) and its tokenizer to ``root/step_N``; the logged mean rewards go to
    ``record["reward_mean"]``."""
    from transformers import TrainerCallback  # imported here: only the TRL worker has it loaded

    def save(step: int) -> str:
        path = os.path.join(root, f"step_{step}")
        trainer.save_model(path)
        trainer.processing_class.save_pretrained(path)
        return path

    clock = TrlClock(save, record, budget_s=budget_s, save_every_s=save_every_s)

    class Checkpoints(TrainerCallback):
        def on_step_begin(self, _args, _state, _control, **_kw):
            clock.step_begin()

        def on_step_end(self, _args, state, control, **_kw):
            if clock.step_end(state.global_step):
                control.should_training_stop = True

        def on_train_end(self, _args, state, _control, **_kw):  # max_steps before the budget
            clock.save_last(state.global_step)

        def on_log(self, _args, _state, _control, logs=None, **_kw):
            if logs and "reward" in logs:
                record.setdefault("reward_mean", []).append(float(logs["reward"]))

    return Checkpoints()


# ----------------------------------------------------------------------------------------------
# The policygrad side's checkpoints (read from its run folder).


def policygrad_points(run_dir: Path) -> tuple[list[float], list[dict[str, Any]]]:
    """``(each step's time/step_s, the checkpoints)`` of a finished ``policygrad train`` run: every
    complete ``checkpoints/step_N`` with its step, training seconds (the steps' times summed up to
    N) and model folder."""
    import json

    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    by_step = {int(r["step"]): float(r["time/step_s"]) for r in rows if "time/step_s" in r and "step" in r}
    step_s = [by_step[k] for k in sorted(by_step)]
    points = []
    for folder in (run_dir / "checkpoints").glob("step_*"):
        if not (folder / "COMPLETE").exists():
            continue
        step = int(folder.name.removeprefix("step_"))
        points.append(
            {
                "step": step,
                "train_s": sum(v for k, v in by_step.items() if k <= step),
                "model_dir": str(folder / "model"),
            }
        )
    return step_s, sorted(points, key=lambda p: p["step"])


class TrimCheckpoints:
    """While a ``policygrad train`` run goes on, delete each complete checkpoint's
    ``trainer_state.pt`` (the optimizer state, twice the model's size; evaluation reads only
    ``model/``), so a run of many checkpoints fits on the disk. Unlinking a file costs the run
    next to nothing; nothing of the run reads an older checkpoint (``keep_checkpoints`` is off)."""

    def __init__(self, run_dir: Path, every_s: float = 2.0):
        self.root = run_dir / "checkpoints"
        self.every_s = every_s
        self.freed_gb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> TrimCheckpoints:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()
        self.trim()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.trim()

    def trim(self) -> None:
        for state in self.root.glob("step_*/trainer_state.pt"):
            if (state.parent / "COMPLETE").exists():
                try:
                    size = state.stat().st_size
                    state.unlink()
                    self.freed_gb += size / 1e9
                except OSError:
                    pass


# ----------------------------------------------------------------------------------------------
# Time to target.


def time_to_target(curve: Sequence[tuple[float, float]], target: float, hold: int = 1) -> float | None:
    """Training seconds of the first point of ``curve`` (``(seconds, accuracy)``, in time order,
    the start model at 0 s first) at or above ``target`` and held there by the ``hold - 1``
    points after it; None when none does (a crossing too near the curve's end to be held counts
    as not reached).

    ``hold`` > 1 guards the first-crossing time against the noise of single evaluations: a side
    with more checkpoints has more chances of one evaluation landing above a line by luck, and
    needing the next checkpoints to stay above it takes most of that away.

    Raises:
        ValueError: ``hold`` < 1.
    """
    if hold < 1:
        raise ValueError(f"hold must be >= 1, got {hold}")

    def above(accuracy):
        return accuracy is not None and accuracy >= target - 1e-9

    for i in range(len(curve) - hold + 1):
        if all(above(accuracy) for _, accuracy in curve[i : i + hold]):
            return curve[i][0]
    return None


def median_or_none(values: Sequence[float | None]) -> float | None:
    """Median over seeds with a seed that never reached the target counted as later than any that
    did: None (not reached) unless more than half of the seeds reached it."""
    if not values:
        return None
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    as_inf = [math.inf if v is None else v for v in ordered]
    m = statistics.median(as_inf)
    return None if math.isinf(m) or math.isnan(m) else m


def auto_targets(start: float, best: float, resolution: float) -> list[float]:
    """:data:`TARGET_FRACTIONS` of the way from ``start`` to ``best``, rounded up to a multiple of
    ``resolution`` (1 / the number of problems), above ``start``, distinct."""
    if not best > start:
        return []
    out = []
    for f in TARGET_FRACTIONS:
        value = math.ceil(round((start + f * (best - start)) / resolution, 6)) * resolution
        value = round(min(value, best), 6)
        if value > start and value not in out:
            out.append(value)
    return out


def target_rows(
    curves: dict[str, list[list[tuple[float, float]]]], targets: list[float], hold: int = 1
) -> list[dict]:
    """Per target: each side's seconds per seed (None: not reached; ``hold`` as in
    :func:`time_to_target`), median, range, count, and the ratio policygrad / TRL of the medians
    where both reach it."""
    rows = []
    for target in targets:
        row: dict[str, Any] = {"target": target}
        for side, seeds in curves.items():
            seconds = [time_to_target(c, target, hold) for c in seeds]
            reached = [s for s in seconds if s is not None]
            row[side] = {
                "seconds": seconds,
                "median": median_or_none(seconds),
                "min": min(reached) if reached else None,
                "max": max(reached) if reached else None,
                "reached": len(reached),
                "seeds": len(seconds),
            }
        pg, trl = row.get("policygrad", {}).get("median"), row.get("trl", {}).get("median")
        row["ratio"] = pg / trl if pg is not None and trl else None
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# Tables.


def _range(values: Sequence[float], digits: int) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < 2:
        return ""
    return f" [{min(finite):.{digits}f}-{max(finite):.{digits}f}]"


def _seconds_cell(cell: dict[str, Any]) -> str:
    if cell["median"] is None:
        where = f"; {cell['reached']}/{cell['seeds']} reached" if cell["reached"] else ""
        return f"not reached{where}"
    spread = ""
    if cell["seeds"] > 1:
        top = fmt(cell["max"], 0) if cell["reached"] == cell["seeds"] else "not reached"
        spread = f" [{fmt(cell['min'], 0)}-{top}]"
    return f"{fmt(cell['median'], 0)}{spread}"


def target_table(task: str, start: float, rows: list[dict[str, Any]], seeds: int, hold: int = 1) -> str:
    """Time to each target, both sides: median seconds [fastest-slowest seed] and the ratio;
    ``hold`` > 1 names the rows' rule (:func:`time_to_target`) in the first column's header."""
    held = f", held {hold} checkpoints" if hold > 1 else ""
    header = [
        f"{task}: target accuracy (start {start:.3f}){held}",
        f"policygrad, s to target (median of {seeds} [range])",
        f"TRL, s to target (median of {seeds} [range])",
        "policygrad / TRL",
    ]
    body = [
        [
            f"{r['target']:.3f}",
            _seconds_cell(r["policygrad"]),
            _seconds_cell(r["trl"]),
            f"**{fmt(r['ratio'])}**" if r["ratio"] is not None else "-",
        ]
        for r in rows
    ]
    return markdown_table(header, body)


def curve_table(task: str, start: float, runs: dict[str, list[dict[str, Any]]]) -> str:
    """Accuracy against training seconds: row k is each side's k-th checkpoint (0: the start
    model), median training seconds and median accuracy over the seeds that have it, [range]."""
    header = [f"{task}: checkpoint", "policygrad: training s", "accuracy", "TRL: training s", "accuracy"]
    depth = max((len(r["checkpoints"]) for side in runs.values() for r in side), default=0)
    body = [["0 (start model)", "0", f"{start:.3f}", "0", f"{start:.3f}"]]
    for k in range(depth):
        row: list[str] = [str(k + 1)]
        for side in ("policygrad", "trl"):
            points = [r["checkpoints"][k] for r in runs.get(side, []) if len(r["checkpoints"]) > k]
            secs = [p["train_s"] for p in points]
            accs = [p.get("accuracy") for p in points if p.get("accuracy") is not None]
            n = len(runs.get(side, []))
            few = f" ({len(points)}/{n} seeds)" if n and len(points) < n else ""
            row.append(f"{fmt(statistics.median(secs), 0)}{few}" if secs else "-")
            row.append(f"{fmt(statistics.median(accs), 3)}{_range(accs, 3)}" if accs else "-")
        body.append(row)
    return markdown_table(header, body)


def side_line(side: str, runs: list[dict[str, Any]]) -> str:
    """One line per side: steps, seconds per step, training seconds reached and time outside the
    steps (saves, bookkeeping), medians over the seeds."""

    def med(key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else math.nan

    return (
        f"{side}: {fmt(med('steps'), 0)} steps, {fmt(med('seconds_per_step'))} s per step, "
        f"{fmt(med('train_s'), 0)} training s, {fmt(med('outside_steps_s'), 0)} s outside the steps "
        f"(medians of {len(runs)} seed(s))"
    )


# ----------------------------------------------------------------------------------------------
# Joining runs made on other seeds.

MERGE_FREE_SETTINGS = ("seeds", "seed_list", "targets")
"""Settings the runs a merge joins may differ in: their seeds, and the targets (the merge's own)."""
MERGE_MACHINE_KEYS = ("cpu_model", "cpu_flags", "logical_cores", "physical_cores", "packages")
"""What must be the same machine for training seconds to be comparable across the runs."""


def merge_results(parts: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One result from finished runs of the same measurement on other seeds (``(name, result)``
    pairs, in the order given): every task's runs concatenated side by side, the seed lists joined,
    each part's command, date, load averages and minutes kept under ``merged_from``. The
    summaries (targets, time-to-target rows) are left for the caller to compute again.

    Raises:
        ValueError: fewer than two parts, a part that did not finish, parts whose settings, machine,
            tasks or start accuracies differ (naming the field), or a seed in two parts.
    """
    if len(parts) < 2:
        raise ValueError("a merge needs at least two results")
    first_name, first = parts[0]
    seen: dict[int, str] = {}
    for name, part in parts:
        _check_same_measurement(name, part, first_name, first)
        for seed in part["settings"]["seed_list"]:
            if seed in seen:
                raise ValueError(f"{name}: seed {seed} is in {seen[seed]} too")
            seen[seed] = name
    merged = {
        "benchmark": first["benchmark"],
        "machine": dict(first["machine"]),
        "settings": dict(first["settings"], seed_list=list(seen), seeds=len(seen)),
        "complete": True,
        "merged_from": [
            {
                "name": name,
                "command": part["command"],
                "date": part["date"],
                "loadavg_at_start": part["machine"].get("loadavg_at_start"),
                "loadavg_at_end": part["machine"].get("loadavg_at_end"),
                "wall_minutes": part.get("wall_minutes"),
                "logs": part.get("logs"),
            }
            for name, part in parts
        ],
        "wall_minutes": sum(part.get("wall_minutes") or 0.0 for _, part in parts),
        "tasks": {},
    }
    for key in ("loadavg_at_start", "loadavg_at_end"):  # a merge has one per part (above)
        merged["machine"].pop(key, None)
    for task, entry in first["tasks"].items():
        runs = {side: [r for _, p in parts for r in p["tasks"][task]["runs"][side]] for side in entry["runs"]}
        merged["tasks"][task] = {"minutes": entry["minutes"], "start": entry["start"], "runs": runs}
    return merged


def _check_same_measurement(name: str, part: dict[str, Any], first_name: str, first: dict[str, Any]) -> None:
    """Raise ValueError naming the first field in which ``part`` is not ``first``'s measurement."""
    if part.get("benchmark") != first.get("benchmark"):
        raise ValueError(f"{name}: benchmark {part.get('benchmark')!r}, not {first.get('benchmark')!r}")
    if not part.get("complete"):
        raise ValueError(f"{name}: an interrupted run (complete: false); merge only finished runs")
    for key in sorted(set(part["settings"]) | set(first["settings"])):
        if key not in MERGE_FREE_SETTINGS and part["settings"].get(key) != first["settings"].get(key):
            raise ValueError(
                f"{name}: setting {key!r} is {part['settings'].get(key)!r}, "
                f"{first_name} has {first['settings'].get(key)!r}"
            )
    for key in MERGE_MACHINE_KEYS:
        if part["machine"].get(key) != first["machine"].get(key):
            raise ValueError(f"{name}: machine {key!r} differs from {first_name}'s")
    if list(part["tasks"]) != list(first["tasks"]):
        raise ValueError(f"{name}: tasks {list(part['tasks'])}, {first_name} has {list(first['tasks'])}")
    for task, entry in part["tasks"].items():
        # the evaluator is deterministic: another start accuracy means another evaluation
        if entry["start"]["accuracy"] != first["tasks"][task]["start"]["accuracy"]:
            raise ValueError(f"{name}: {task}'s start accuracy differs from {first_name}'s")


def merged_line(result: dict[str, Any]) -> str:
    """The report's first sentence's list of the runs a merged result joins."""
    out = []
    for p in result["merged_from"]:
        load = p.get("loadavg_at_start") or [math.nan]
        end = p.get("loadavg_at_end")
        out.append(
            f"`{p['command']}` ({p['date']}, load average {load[0]:.2f} at the start"
            + (f", {end[0]:.2f} at the end" if end else "")
            + f", {fmt(p.get('wall_minutes') or math.nan, 0)} min)"
        )
    return "; ".join(out)
