"""benchmarks/_learning.py: the TRL side's clock and checkpoints, and time to a target over seeds."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def learning(import_script):
    return import_script("_learning")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_trl_clock_counts_steps_not_saves_and_stops_after_the_budget(learning):
    clock, saved, record = FakeClock(), [], {}

    def save(step):
        saved.append(step)
        clock.now += 5.0  # a save takes 5 s: wall time, not training time
        return f"ckpt/step_{step}"

    c = learning.TrlClock(save, record, budget_s=100.0, save_every_s=30.0, clock=clock)
    steps = 0
    while True:
        steps += 1
        c.step_begin()
        clock.now += 12.0
        clock.now += 0.5  # between the step's end and the next begin: bookkeeping
        if c.step_end(steps):
            break
    # steps end at wall 12.5, 25, 37.5 (save -> 42.5), 55, 67.5, 80 (save -> 85), 97.5, 110 > 100: stop
    assert record["step_s"] == [12.5] * steps  # the fake clock moves the bookkeeping inside the step
    assert saved == [3, 6, 8]
    points = record["checkpoints"]
    assert [p["train_s"] for p in points] == [37.5, 75.0, 100.0]  # the steps' times only
    assert [p["save_s"] for p in points] == [5.0, 5.0, 5.0]
    assert points[-1]["model_dir"] == "ckpt/step_8"
    c.save_last(8)  # the end of training saves nothing twice
    assert saved == [3, 6, 8]


def test_time_to_target_and_the_median_over_seeds(learning):
    curve = [(0.0, 0.1), (60.0, 0.2), (120.0, 0.35), (180.0, 0.3)]
    assert learning.time_to_target(curve, 0.1) == 0.0
    assert learning.time_to_target(curve, 0.3) == 120.0
    assert learning.time_to_target(curve, 0.4) is None
    assert learning.median_or_none([60.0, None, 120.0]) == 120.0  # a seed that never reached is the slowest
    assert learning.median_or_none([60.0, None, None]) is None
    rows = learning.target_rows(
        {"policygrad": [curve, curve], "trl": [[(0.0, 0.1), (300.0, 0.35)]] * 2}, [0.3]
    )
    assert rows[0]["policygrad"]["median"] == 120.0 and rows[0]["trl"]["median"] == 300.0
    assert rows[0]["ratio"] == pytest.approx(0.4)


def test_a_held_crossing_needs_the_next_checkpoints_above_the_target(learning):
    # one lucky evaluation at 30 s (0.40) dips back to 0.25; the curve holds 0.35+ from 90 s on
    curve = [(0.0, 0.2), (30.0, 0.40), (60.0, 0.25), (90.0, 0.35), (120.0, 0.36), (150.0, 0.34)]
    assert learning.time_to_target(curve, 0.35) == 30.0  # the first crossing takes the lucky one
    assert learning.time_to_target(curve, 0.35, hold=2) == 90.0  # 0.35 and 0.36 both at or above
    assert learning.time_to_target(curve, 0.36, hold=2) is None  # 0.36 at 120 s, 0.34 after it
    assert learning.time_to_target(curve, 0.35, hold=3) is None  # 0.34 at 150 s breaks the run
    assert learning.time_to_target(curve, 0.2, hold=6) == 0.0  # the whole curve at or above 0.2
    assert learning.time_to_target(curve, 0.2, hold=7) is None  # longer than the curve
    assert learning.time_to_target(curve, 0.35, hold=1) == learning.time_to_target(curve, 0.35)
    with pytest.raises(ValueError, match="hold"):
        learning.time_to_target(curve, 0.35, hold=0)
    rows = learning.target_rows(
        {"policygrad": [curve], "trl": [[(0.0, 0.2), (100.0, 0.35), (200.0, 0.4)]]}, [0.35], 2
    )
    assert rows[0]["policygrad"]["seconds"] == [90.0] and rows[0]["trl"]["seconds"] == [100.0]
    assert rows[0]["ratio"] == pytest.approx(0.9)


def test_automatic_targets_lie_between_the_start_and_the_best(learning):
    assert learning.auto_targets(0.07, 0.27, 1 / 200) == [0.12, 0.17, 0.22, 0.25]
    assert learning.auto_targets(0.3, 0.3, 1 / 200) == []
    assert learning.parse_tasks("hard,medium:5", 10) == [("hard", 10.0), ("medium", 5.0)]
    with pytest.raises(SystemExit):
        learning.parse_tasks("extreme", 10)
    assert learning.parse_targets("0.3,0.2") == [0.2, 0.3]
    assert learning.parse_targets(None) is None


def test_only_complete_checkpoints_lose_their_optimizer_state(learning, tmp_path):
    for name, complete in (("step_1", True), ("step_2", False)):
        folder = tmp_path / "checkpoints" / name
        (folder / "model").mkdir(parents=True)
        (folder / "trainer_state.pt").write_bytes(b"x" * 1000)
        if complete:
            (folder / "COMPLETE").write_text("{}")
    with learning.TrimCheckpoints(tmp_path, every_s=0.01) as trim:
        pass
    assert not (tmp_path / "checkpoints/step_1/trainer_state.pt").exists()
    assert (tmp_path / "checkpoints/step_1/model").is_dir()
    assert (tmp_path / "checkpoints/step_2/trainer_state.pt").exists()  # a save still being written
    assert trim.freed_gb == 1000 / 1e9


def test_a_policygrad_checkpoint_is_timed_by_the_steps_before_it(learning, tmp_path):
    rows = [{"step": k, "time/step_s": 10.0 * k} for k in (1, 2, 3)] + [{"step": 3, "eval/accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for step, complete in ((2, True), (3, True), (4, False)):
        folder = tmp_path / "checkpoints" / f"step_{step}"
        (folder / "model").mkdir(parents=True)
        if complete:
            (folder / "COMPLETE").write_text("{}")
    step_s, points = learning.policygrad_points(tmp_path)
    assert step_s == [10.0, 20.0, 30.0]
    assert [(p["step"], p["train_s"]) for p in points] == [(2, 30.0), (3, 60.0)]
    assert points[0]["model_dir"] == str(tmp_path / "checkpoints" / "step_2" / "model")
