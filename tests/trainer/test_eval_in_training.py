"""In-training evaluation goes through the same evaluation as ``policygrad eval``: with
``eval_samples`` it logs pass@k and maj@k next to the greedy accuracy, under METRICS names."""

from __future__ import annotations

import json

import pytest

from policygrad.learn.metrics import is_known_metric
from policygrad.run import Run

pytestmark = pytest.mark.integration


def test_eval_samples_log_pass_and_maj_at_k(make_config, tmp_path):
    cfg = make_config(
        "run",
        steps=1,
        reward_fn="length_fraction",
        eval_before=True,
        eval_after=True,
        eval_samples=4,
        eval_k=[1, 4],
        data={"eval_size": 3},
    )
    run = Run(cfg)
    try:
        summary = run.train()
    finally:
        run.close()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    evals = [r for r in rows if "eval/pass@4" in r]
    assert [r["step"] for r in evals] == [0, 1]
    for row in evals:
        for name in ("eval/accuracy", "eval/pass@1", "eval/pass@4", "eval/maj@1", "eval/maj@4"):
            assert 0.0 <= row[name] <= 1.0 and is_known_metric(name)
        assert row["eval/pass@1"] <= row["eval/pass@4"]
    assert "pass@4_after" in summary and "maj@1_after" in summary
    records = [json.loads(line) for line in open(tmp_path / "run" / "eval_after.jsonl")]
    assert len(records) == 3 and all(len(r["samples"]) == 4 for r in records)
