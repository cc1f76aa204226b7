"""Tests of pass@k: the unbiased estimator worked by hand, the k ladder, and ``--k``."""

from __future__ import annotations

import pytest

from policygrad.lab.passk_curve import k_ladder, parse_ks, pass_at_k_curve


@pytest.mark.unit
def test_pass_at_k_by_hand():
    # n = 4 samples, c = 1 correct: pass@k = 1 - C(n-c, k) / C(n, k)
    #   k=1: 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25
    #   k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    #   k=4: C(3,4) = 0 (fewer wrong samples than k): 1
    assert pass_at_k_curve([1], 4, [1, 2, 4]) == {1: 0.25, 2: 0.5, 4: 1.0}
    # c = 2 of 4: k=1: 1 - 2/4 = 0.5; k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6; k=4: 1.
    # The mean with a problem never solved (c = 0: pass@k = 0 for every k) halves each value.
    curve = pass_at_k_curve([2, 0], 4, [1, 2, 4])
    assert curve[1] == pytest.approx(0.25)
    assert curve[2] == pytest.approx(5 / 12)
    assert curve[4] == pytest.approx(0.5)
    # n = 6, c = 1, k = 3: 1 - C(5,3)/C(6,3) = 1 - 10/20 = 0.5 (= k/n when c = 1).
    assert pass_at_k_curve([1], 6, [3]) == {3: pytest.approx(0.5)}
    assert pass_at_k_curve([], 4, [1]) == {1: 0.0}
    with pytest.raises(ValueError, match="k=5 must be <= n=4"):
        pass_at_k_curve([1], 4, [5])
    with pytest.raises(ValueError, match=r"c=5 must be in \[0, n=4\]"):
        pass_at_k_curve([5], 4, [1])


@pytest.mark.unit
def test_k_ladder_is_powers_of_two_and_n():
    assert k_ladder(1) == [1]
    assert k_ladder(2) == [1, 2]
    assert k_ladder(32) == [1, 2, 4, 8, 16, 32]
    assert k_ladder(6) == [1, 2, 4, 6]  # n not a power of two: n itself ends the ladder
    assert k_ladder(33) == [1, 2, 4, 8, 16, 32, 33]
    with pytest.raises(ValueError, match="--samples must be an integer >= 1, got 0"):
        k_ladder(0)


@pytest.mark.unit
def test_parse_ks():
    assert parse_ks(None, 6) == [1, 2, 4, 6]
    assert parse_ks("4, 1,4", 6) == [1, 4]
    with pytest.raises(ValueError, match=r"--k 1,8: each k must be in 1 \.\. --samples 4 .* drop 8"):
        parse_ks("1,8", 4)
    with pytest.raises(ValueError, match="must be comma-separated integers"):
        parse_ks("1,two", 4)
    with pytest.raises(ValueError, match="--k ',' names no k"):
        parse_ks(",", 4)
