"""benchmarks/learn_vs_trl.py: the report names the loss aggregation policygrad trained with (the
preset's, or the one ``--pg-override`` gave), so a variant's table cannot pass for the default's;
a saved result from before the field existed still renders."""

from __future__ import annotations

import json
import math
import os
import types

import pytest

from tests.benchmarks.conftest import BENCH

pytestmark = pytest.mark.unit

RESULT = os.path.join(BENCH, "results", "2026-12-05-learn-vs-trl-time-to-target.json")


@pytest.fixture
def lvt(import_script):
    return import_script("learn_vs_trl")


def saved_result() -> dict:
    """The saved hard-task result (its JSON writes NaN as null; the report formats floats)."""

    def nan(value):
        if isinstance(value, dict):
            return {k: nan(v) for k, v in value.items()}
        if isinstance(value, list):
            return [nan(v) for v in value]
        return math.nan if value is None else value

    with open(RESULT, encoding="utf-8") as f:
        result = json.load(f)
    result["tasks"] = nan(result["tasks"])
    return result


def args_of(*overrides: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        save_every=1.0,
        eval_size=200,
        eval_engine="auto",
        targets=None,
        threads=2,
        pg_engine="auto",
        pg_override=list(overrides),
        trl_override=["bf16=false"],
    )


@pytest.mark.parametrize(
    ("overrides", "agg_mode"), [((), None), (("loss.agg_mode=token-mean",), "token-mean")]
)
def test_the_settings_and_the_report_name_policygrads_loss_aggregation(lvt, overrides, agg_mode, tmp_path):
    args = args_of(*overrides)
    base = lvt.policygrad_base(args, task="hard", minutes=10, seed=0, output_dir=str(tmp_path))
    cfg = lvt.policygrad_config(base, args.pg_override)
    settings = lvt.settings(args, cfg, [("hard", 10.0)], [0, 1, 2])
    preset = cfg.preset.loss_agg_mode  # the default job's preset decides when nothing overrides it
    assert settings["pg_agg_mode"] == (agg_mode or preset)
    assert agg_mode is None or agg_mode != preset  # the override is a real change of the objective
    result = saved_result()
    result["settings"]["pg_agg_mode"] = settings["pg_agg_mode"]
    footer = lvt.report(result).splitlines()[-1]
    assert f"(vllm engine, loss aggregation `{settings['pg_agg_mode']}`); TRL fp32," in footer


def test_a_result_saved_before_the_aggregation_was_recorded_still_renders(lvt):
    text = lvt.report(saved_result())
    assert "loss aggregation" not in text  # not guessed: that run's JSON did not record it
    assert "| 0.115 | 66 [62-68] | 64 [64-191] | **1.03** |" in text  # the README's table, unchanged


def test_the_summary_adds_the_held_table_and_the_report_renders_it(lvt):
    result = saved_result()
    entry = result["tasks"]["hard"]
    assert ", held 2 checkpoints" not in lvt.report(result)  # saved before the held rows: as it was
    lvt.summarise_task(entry, entry["targets"], 200)
    assert entry["hold"] == lvt.HOLD == 2
    held = entry.pop("time_to_target_held")
    plain = lvt.report(result)
    entry["time_to_target_held"] = held
    text = lvt.report(result)
    assert plain.split("\n\n")[1] in text  # the first-crossing table, unchanged
    assert f"(start {entry['start']['accuracy']:.3f}), held 2 checkpoints |" in text
    assert "Held 2 checkpoints: the first of 2 consecutive checkpoints" in text
    assert "Held 2" not in plain
    for first_rows, held_rows in zip(entry["time_to_target"], held, strict=True):
        for side in ("policygrad", "trl"):
            for first, kept in zip(first_rows[side]["seconds"], held_rows[side]["seconds"], strict=True):
                # holding can only make a target later or unreached, never sooner
                assert kept is None or (first is not None and kept >= first)


BF16 = os.path.join(BENCH, "results", "2026-12-06-learn-vs-trl-medium-bf16.json")


def bf16_result() -> dict:
    with open(BF16, encoding="utf-8") as f:
        return json.load(f)


def on_other_seeds(result: dict, shift: int) -> dict:
    """The same runs as if measured on seeds ``shift`` higher."""
    other = json.loads(json.dumps(result))
    other["settings"]["seed_list"] = [s + shift for s in result["settings"]["seed_list"]]
    for entry in other["tasks"].values():
        for runs in entry["runs"].values():
            for run in runs:
                run["seed"] += shift
    return other


def test_a_merge_of_a_result_with_a_copy_of_itself_keeps_every_median_and_ratio(lvt):
    # Each seed's time to a target appears twice: the median of [a, a, b, b, c, c] is b, the
    # median of [a, b, c]; so every median, range and ratio is the original's and only the counts
    # double. A merge that dropped, reordered across sides or mis-paired runs would change them.
    result = bf16_result()
    merged = lvt.merge_results([("a.json", result), ("b.json", on_other_seeds(result, 3))])
    assert merged["settings"]["seed_list"] == [0, 1, 2, 3, 4, 5] and merged["settings"]["seeds"] == 6
    assert [p["name"] for p in merged["merged_from"]] == ["a.json", "b.json"]
    assert merged["wall_minutes"] == pytest.approx(2 * result["wall_minutes"], rel=1e-12)
    task = merged["tasks"]["medium"]
    assert [r["seed"] for r in task["runs"]["policygrad"]] == [0, 1, 2, 3, 4, 5]
    assert [r["seed"] for r in task["runs"]["trl"]] == [0, 1, 2, 3, 4, 5]
    original = result["tasks"]["medium"]
    lvt.summarise_task(task, original["targets"], 200)
    assert task["targets"] == original["targets"]
    for key in ("time_to_target", "time_to_target_held"):
        for row, before in zip(task[key], original[key], strict=True):
            assert row["ratio"] == before["ratio"]
            for side in ("policygrad", "trl"):
                for field in ("median", "min", "max"):
                    assert row[side][field] == before[side][field]
                assert row[side]["reached"] == 2 * before[side]["reached"]
                assert row[side]["seconds"] == before[side]["seconds"] * 2


def test_the_merged_report_names_every_joined_run_and_all_the_seeds(lvt):
    result = bf16_result()
    merged = lvt.merge_results([("a.json", result), ("b.json", on_other_seeds(result, 3))])
    merged.update(date="2026-12-06", command="python benchmarks/learn_vs_trl.py --merge a.json b.json")
    for entry in merged["tasks"].values():
        lvt.summarise_task(entry, None, 200)
    text = lvt.report(merged)
    first = text.splitlines()[0]
    assert first.startswith(f"Joined 2026-12-06 with `{merged['command']}` from 2 runs")
    # both parts' own commands and load averages (the saved run's: 0.22 at the start, 10.50 at the end)
    part = f"`{result['command']}` (2026-12-06, load average 0.22 at the start, 10.50 at the end"
    assert first.count(part) == 2
    assert "seeds [0, 1, 2, 3, 4, 5], one side after the other" in text.splitlines()[-1]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.update(complete=False), "interrupted run"),
        (lambda r: r["settings"].update(threads=1), "setting 'threads' is 1"),
        (lambda r: r["settings"].update(pg_precision="fp32"), "setting 'pg_precision'"),
        (lambda r: r["machine"].update(cpu_model="Intel Xeon"), "machine 'cpu_model'"),
        (lambda r: r["tasks"]["medium"]["start"].update(accuracy=0.24), "start accuracy"),
        (lambda r: r["settings"].update(seed_list=[2, 3, 4]), "seed 2 is in a.json too"),
    ],
)
def test_a_merge_refuses_runs_that_are_not_the_same_measurement(lvt, change, message):
    result = bf16_result()
    other = on_other_seeds(result, 3)
    change(other)
    with pytest.raises(ValueError, match=message):
        lvt.merge_results([("a.json", result), ("b.json", other)])
    assert result == bf16_result()  # the parts themselves are not touched


def test_a_merge_ignores_the_parts_targets_and_needs_two_parts(lvt):
    result = bf16_result()
    other = on_other_seeds(result, 3)
    other["settings"]["targets"] = "0.345,0.45"  # the merge's own --targets decide
    assert lvt.merge_results([("a.json", result), ("b.json", other)])["settings"]["seeds"] == 6
    with pytest.raises(ValueError, match="at least two"):
        lvt.merge_results([("a.json", result)])
