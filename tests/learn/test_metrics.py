"""Every metric name is defined once (``policygrad.learn.metrics.METRICS``): every name a run
logs is in the table, and the docs' metrics reference (docs/metrics.md) is the table."""

from __future__ import annotations

import os
import re

import pytest

from policygrad.learn.metrics import METRICS, is_known_metric, metrics_markdown
from policygrad.run import Run

README = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "metrics.md")


@pytest.mark.unit
def test_the_readme_lists_exactly_the_metric_table():
    text = open(README, encoding="utf-8").read()
    found = re.search(r"<!-- metrics:start -->\n(.*?)\n<!-- metrics:end -->", text, re.S)
    assert found, "docs/metrics.md has no metrics:start/end block"
    assert found.group(1).strip() == metrics_markdown()


@pytest.mark.unit
def test_component_names_match_their_pattern_only():
    assert is_known_metric("reward_fn/answer_correctness/mean")
    assert is_known_metric("reward_fn/rewards/my.py:f#2/invalid")  # a file spec is the name
    assert not is_known_metric("reward_fn/answer_correctness/median")
    assert not is_known_metric("policy/clip_frac")
    assert all(meaning.strip() for meaning in METRICS.values())


@pytest.mark.integration
@pytest.mark.parametrize(
    "sections",
    [
        {
            "kl": {"placement": "loss", "beta": 0.1},
            "rollout": {"is_correction": "token"},
            "drop_zero_variance_groups": True,
            "dynamic_sampling": {"max_extra_rounds": 1},
            "reward": {"on_error": "skip"},
        },
        {
            "algorithm": "ppo",
            "kl": {"placement": "reward", "beta": 0.1},
            "optim": {"target_kl": 10.0, "ppo_epochs": 2},
            "critic": {"lr": 1e-2},
        },
    ],
    ids=["grpo", "ppo"],
)
def test_every_logged_metric_is_in_the_table(sections, make_config):
    m = Run(make_config(**sections)).trainer.step()
    unknown = sorted(k for k in m if not is_known_metric(k))
    assert not unknown, f"metrics missing from METRICS: {unknown}"
