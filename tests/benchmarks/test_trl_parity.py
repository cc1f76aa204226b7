"""benchmarks/trl_parity.py: the statistics its ``steps`` and ``batch`` reports rest on."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit


@pytest.fixture
def parity(import_script):
    return import_script("trl_parity")


def test_rank_sum_counts_ties_as_halves_and_enumerates_every_split(parity):
    # [3, 4] over [1, 2]: all 4 pairs higher; of the C(4, 2) = 6 splits of {1, 2, 3, 4} only the
    # observed one reaches U = 4, so p = 1/6.
    assert parity.rank_sum([3.0, 4.0], [1.0, 2.0]) == (4.0, pytest.approx(1 / 6, abs=1e-15))
    # one tie: [2, 3] over [2, 1]: 3 > 2, 3 > 1, 2 > 1, 2 = 2 -> U = 3.5. The six splits of the
    # pooled [2, 3, 2, 1] (two 2s) give U = 3.5, 3.5 ({2, 3} with either 2), 2, 2 ({2, 2}, {1, 3}),
    # 0.5, 0.5 ({1, 2} with either 2): 2 of 6 at or above 3.5.
    assert parity.rank_sum([2.0, 3.0], [2.0, 1.0]) == (3.5, pytest.approx(2 / 6, abs=1e-15))
    # the mirror image, U = 0.5, is the smallest any split reaches: p = 1
    assert parity.rank_sum([2.0, 1.0], [2.0, 3.0]) == (0.5, 1.0)


def test_hodges_lehmann_shift_and_its_exact_interval(parity):
    # 6 and 6: P(U < 6) = 19/924 = 0.0206 <= 0.025 < P(U < 7), so k = 6 and the interval is the
    # 6th smallest and 6th largest of the 36 differences, with coverage 1 - 38/924.
    a = [0.16, 0.195, 0.17, 0.185, 0.12, 0.04]
    b = [0.16, 0.095, 0.16, 0.02, 0.115, 0.18]
    shift, low, high, coverage = parity.hodges_lehmann(a, b)
    diffs = sorted(x - y for x in a for y in b)
    assert shift == pytest.approx((diffs[17] + diffs[18]) / 2, abs=1e-15)
    assert (low, high) == (diffs[5], diffs[30])
    assert coverage == pytest.approx(1 - 38 / 924, abs=1e-15)
    assert shift == pytest.approx(0.0225, abs=1e-12) and (round(low, 3), round(high, 3)) == (-0.055, 0.1)
    # a shift of every value moves the estimate by the same amount
    moved = parity.hodges_lehmann([x + 0.25 for x in a], b)
    assert moved[0] == pytest.approx(shift + 0.25, abs=1e-12)


def test_hodges_lehmann_with_too_few_values_has_no_finite_interval(parity):
    # 3 and 3: P(U = 0) = 1/20 = 0.05 > 0.025, so no k reaches 95 %: the interval is unbounded
    shift, low, high, coverage = parity.hodges_lehmann([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert shift == 2.0 and low == float("-inf") and high == float("inf") and coverage == 1.0


def test_the_null_counts_are_the_enumerated_ones_and_many_seeds_stay_cheap(parity):
    # 2 and 2: the 6 orderings give U = 0, 1, 2, 2, 3, 4 (the pairs won by the first sample)
    assert parity.u_null_counts(2, 2) == [1, 1, 2, 1, 1]
    assert sum(parity.u_null_counts(6, 6)) == 924 and sum(parity.u_null_counts(12, 12)) == 2_704_156
    # 12 and 12 fully separated: more splits than are enumerated, so p comes from the seeded
    # random splits; none reaches U = 144, p = 1 / (200000 + 1)
    high, low = [float(100 + i) for i in range(12)], [float(i) for i in range(12)]
    assert parity.rank_sum(high, low) == (144.0, pytest.approx(1 / 200_001, rel=1e-12))
    shift, lo, hi, coverage = parity.hodges_lehmann(high, low)
    assert shift == 100.0 and lo < shift < hi and 0.95 <= coverage < 1.0


def test_compare_gradients_by_hand(parity):
    # ours a = [1, -2, 1e-9], b = [[3]]; theirs a = [1, 2, -1e-9], b = [[3]]:
    # ||ours||^2 = ||theirs||^2 = 1 + 4 + 1e-18 + 9 = 14 + 1e-18; the gap is 4 on a[1] and 2e-9 on
    # a[2]: ||gap||^2 = 16 + 4e-18; dot = 1 - 4 - 1e-18 + 9 = 6 - 1e-18. Entries above eps = 1e-8 on
    # either side: a[0], a[1], b[0, 0] (a[2] is below it on both), signs agree on a[0] and b: 2 of 3.
    ours = {"a": torch.tensor([1.0, -2.0, 1e-9]), "b": torch.tensor([[3.0]])}
    theirs = {"a": torch.tensor([1.0, 2.0, -1e-9]), "b": torch.tensor([[3.0]])}
    got = parity.compare_gradients(ours, theirs)
    assert got["policygrad_norm"] == pytest.approx(14**0.5, rel=1e-12)
    assert got["trl_norm"] == pytest.approx(14**0.5, rel=1e-12)
    assert got["relative_gap"] == pytest.approx(4 / 14**0.5, rel=1e-12)
    assert got["cosine"] == pytest.approx(6 / 14, rel=1e-12)
    assert got["weights_above_eps"] == 3
    assert got["same_sign_share"] == pytest.approx(2 / 3, rel=1e-15)
    # with eps below 1e-9 the opposite signs of a[2] count too: 2 of 4
    assert parity.compare_gradients(ours, theirs, eps=1e-10)["same_sign_share"] == 0.5
    # a gradient compared with itself: no gap, cosine 1, every sign the same
    same = parity.compare_gradients(theirs, theirs)
    assert same["relative_gap"] == 0.0 and same["cosine"] == pytest.approx(1.0, rel=1e-15)
    assert same["same_sign_share"] == 1.0
    with pytest.raises(ValueError, match="different parameters"):
        parity.compare_gradients({"a": ours["a"]}, theirs)
