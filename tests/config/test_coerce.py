"""Tests of policygrad.config.coerce: a section built from a mapping, each value coerced to its
annotated type, unknown keys and named choices reported with the dotted field."""

from __future__ import annotations

import pytest

from policygrad.config.checks import ConfigError
from policygrad.config.coerce import build_dataclass, field_choices
from policygrad.config.sections import LoraConfig, ModelConfig

pytestmark = pytest.mark.unit


def test_a_section_is_built_from_a_mapping_with_coerced_values():
    lora = build_dataclass(LoraConfig, {"rank": 4.0, "alpha": 16, "target_modules": ["q_proj"]}, "model.lora")
    assert lora == LoraConfig(rank=4, alpha=16.0, target_modules=["q_proj"])
    assert type(lora.rank) is int and type(lora.alpha) is float
    with pytest.raises(ConfigError, match=r"unknown config key model\.lora\.rnk; valid keys here: alpha"):
        build_dataclass(LoraConfig, {"rnk": 4}, "model.lora")


def test_a_field_with_named_choices_reports_them_instead_of_its_annotation():
    assert field_choices(LoraConfig, "rank") == ""
    choices = field_choices(ModelConfig, "gradient_checkpointing")
    assert choices == "auto (recompute only when the activations would not fit), true or false"
    with pytest.raises(ConfigError) as info:
        build_dataclass(ModelConfig, {"gradient_checkpointing": [1]}, "model")
    assert str(info.value) == f"model.gradient_checkpointing=[1] is not valid; choose {choices}"
