"""The estimator inputs' providers: one table built where both providers are imported, so no
module registers anything by being imported (the import graph has no cycle through them)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from policygrad.core.advantages import get_advantage_estimator
from policygrad.produce import stages, vine
from policygrad.produce.inputs import ESTIMATOR_INPUTS, estimator_inputs, register_estimator_input

pytestmark = pytest.mark.unit


def test_the_table_names_every_input_an_estimator_declares():
    assert ESTIMATOR_INPUTS["baseline_rewards"].sample is stages.sample_greedy_baseline
    assert ESTIMATOR_INPUTS["baseline_rewards"].finish is stages.finish_greedy_baseline
    assert ESTIMATOR_INPUTS["vine_values"].sample is vine.sample_vine
    assert ESTIMATOR_INPUTS["vine_values"].metrics is vine.vine_metrics
    assert ESTIMATOR_INPUTS["vine_segments"].finish is vine.finish_vine_segments
    for name in ("remax", "vineppo", "grpo"):
        spec = get_advantage_estimator(name).spec
        assert list(estimator_inputs(spec.inputs)) == list(spec.inputs)  # in the estimator's order
    with pytest.raises(KeyError, match="estimator input 'nope' has no provider; known: baseline_rewards, "):
        estimator_inputs(["nope"])
    with pytest.raises(ValueError, match="estimator input 'vine_values' already has a provider"):
        register_estimator_input("vine_values", ESTIMATOR_INPUTS["vine_values"])


def test_importing_a_provider_registers_nothing_and_imports_no_table():
    # Before the table, produce/stages.py imported produce/vine.py at its bottom to fill its
    # registry (vine imported stages: a cycle). Now neither provider module imports the table,
    # and stages does not import vine.
    code = (
        "import sys, policygrad.produce.stages, policygrad.produce.vine; "
        "print(sorted(m for m in sys.modules if m.startswith('policygrad.produce')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = ast.literal_eval(out)
    assert loaded == ["policygrad.produce", "policygrad.produce.stages", "policygrad.produce.vine"]
    code = "import sys, policygrad.produce.stages; print('policygrad.produce.vine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
