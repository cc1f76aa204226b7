"""Tests of policygrad.config.checks: ConfigError and the checks every section validates with
(errors name the dotted field)."""

from __future__ import annotations

import pytest

from policygrad.config.checks import ConfigError, check_at_most, check_choice, check_positive

pytestmark = pytest.mark.unit


def test_the_checks_name_the_field():
    check_choice("rollout.engine", "hf", {"auto", "hf", "vllm"})
    with pytest.raises(
        ConfigError, match=r"rollout\.engine='x' is not valid; choose one of \['auto', 'hf'\]"
    ):
        check_choice("rollout.engine", "x", {"hf", "auto"})
    check_positive("data.eval_size", 0, allow_zero=True)
    with pytest.raises(ConfigError, match=r"data\.eval_size must be > 0, got 0: why"):
        check_positive("data.eval_size", 0, why=": why")
    with pytest.raises(ConfigError, match=r"steps must be a number, got True"):
        check_positive("steps", True)


def test_check_at_most_names_the_field_and_its_range():
    check_at_most("loss.entropy_coef", 100.0, 100.0)  # the limit itself is in range
    with pytest.raises(ConfigError) as info:
        check_at_most("loss.entropy_coef", 100.5, 100.0, why=": too big")
    assert str(info.value) == "loss.entropy_coef must be in [0, 100], got 100.5: too big"
    with pytest.raises(ConfigError, match=r"^x must be in \(0, 1\], got 2$"):
        check_at_most("x", 2, 1.0, low="(0")
