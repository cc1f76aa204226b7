"""benchmarks/levers.py: the table of one lever, with the sampler's log-prob gap and the load time
that a lever changing the sampler (vLLM's compilation) must show beside its step time."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def levers(import_script):
    return import_script("levers")


def variant(label, steps, gaps, load_s):
    return {
        "label": label,
        "ready": {"load_s": load_s},
        "steps": [
            {"warmup": i == 0, "metrics": {"mismatch/logprob_abs_mean": g}} for i, g in enumerate(gaps)
        ],
        "summary": {"step": steps, "generation": steps / 2, "peak_rss_gb": 4.0},
        "ratio_to_first": math.nan,
    }


def test_the_table_has_the_samplers_gap_over_the_measured_steps_and_the_load(levers):
    run = {
        "lever": "vllm_compile",
        # the warm-up step's gap (9e-3) is left out: medians of 1e-5, 2e-5, 4e-5 -> 2e-5
        "variants": [
            variant("eager", 10.0, [9e-3, 1e-5, 4e-5, 2e-5], 20.0),
            variant("compiled", 8.0, [9e-3, 3e-5], 140.0),
        ],
    }
    table = levers.lever_table(run)
    assert "| sampler - trainer log-prob, mean abs | 2.0e-05 | 3.0e-05 |" in table
    assert "| load, before the first step (s) | 20.00 | 140.00 |" in table
    # a lever whose steps report no sampler gap (the hf engine) has no such row
    for v in run["variants"]:
        for st in v["steps"]:
            st["metrics"] = {}
    assert "sampler - trainer" not in levers.lever_table(run)
