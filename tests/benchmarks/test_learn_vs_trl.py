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
