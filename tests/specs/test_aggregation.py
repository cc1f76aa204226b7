"""Tests of policygrad.specs.aggregation: the loss aggregation modes, named without torch."""

from __future__ import annotations

import pytest

from policygrad.specs.aggregation import AGGREGATION_MODES

pytestmark = pytest.mark.unit


def test_the_modes_are_the_ones_aggregate_implements():
    assert AGGREGATION_MODES == (
        "token-mean",
        "token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    )
    from policygrad.core import masking  # torch: the implementation, compared with the names

    assert masking.AGGREGATION_MODES is AGGREGATION_MODES
