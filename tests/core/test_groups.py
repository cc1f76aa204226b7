"""Tests of policygrad.core.groups: the one place where group statistics are computed."""

from __future__ import annotations

import pytest
import torch

from policygrad.core import advantages, diagnostics, groups
from policygrad.core.groups import (
    fill_with_group_mean,
    group_inverse,
    group_mean_std,
    group_stats,
    varied_group_rows,
    zero_variance_group_fraction,
)

pytestmark = pytest.mark.unit

NAN = float("nan")


def test_one_implementation_of_each_statistic():
    # advantages and diagnostics re-export the functions of groups; no copies.
    assert advantages.group_mean_std is groups.group_mean_std
    assert advantages.group_inverse is groups.group_inverse
    assert diagnostics.zero_variance_group_fraction is groups.zero_variance_group_fraction


def test_group_inverse_and_group_stats_hand_values():
    # ids 7, 3, 7, 5 -> groups numbered in increasing id order: 3 -> 0, 5 -> 1, 7 -> 2
    gi = torch.tensor([7, 3, 7, 5])
    inverse, sizes = group_inverse(gi)
    assert inverse.tolist() == [2, 0, 2, 1] and sizes.tolist() == [1, 1, 2]
    rewards = torch.tensor([1.5, 2.0, 1.5, -1.0])
    inverse, sizes, sums, constant = group_stats(rewards, gi)
    # group 0 = {2.0}, group 1 = {-1.0}, group 2 = {1.5, 1.5}: all all-equal
    assert sums.tolist() == [2.0, -1.0, 3.0] and constant.tolist() == [True, True, True]
    _, _, _, constant = group_stats(torch.tensor([1.5, 2.0, 0.5, -1.0]), gi)
    assert constant.tolist() == [True, True, False]


def test_group_mean_std_hand_values():
    # group 0 = {1, 3}: mean 2, centred -1, +1, unbiased std sqrt(2), population std 1
    # group 1 = {0.1, 0.1, 0.1}: all equal -> centred and std exactly 0 (no rounding residue)
    rewards = torch.tensor([1.0, 0.1, 3.0, 0.1, 0.1])
    gi = torch.tensor([0, 1, 0, 1, 1])
    centered, std, size = group_mean_std(rewards, gi)
    assert centered.tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(std, torch.tensor([2**0.5, 0.0, 2**0.5, 0.0, 0.0]))
    assert size.tolist() == [2, 3, 2, 3, 3]
    _, std, _ = group_mean_std(rewards, gi, unbiased=False)
    assert std.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_zero_variance_group_fraction_moved_with_its_checks():
    # {1, 1} all equal, {0, 1} varied -> 1 of 2
    assert zero_variance_group_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])) == 0.5
    assert zero_variance_group_fraction(torch.zeros(0), torch.zeros(0, dtype=torch.long)) == 0.0
    with pytest.raises(ValueError, match=r"group_index must have the shape of rewards \(4,\), got \(2,\)"):
        zero_variance_group_fraction(torch.zeros(4), torch.tensor([0, 0]))
    with pytest.raises(TypeError, match=r"group_index must be an integer tensor \(torch.long\)"):
        zero_variance_group_fraction(torch.zeros(2), torch.zeros(2))


# ---------------------------------------------------------------------------------------------
# fill_with_group_mean


def test_fill_with_group_mean_hand_values():
    # rows:   0    1    2      3     4    5     6
    # group:  0    0    0      1     1    2     2
    # score:  1    3    NaN*   -5*   2    8*    9*        (* = missing)
    # group 0: present {1, 3}, mean 2      -> row 2 becomes 2
    # group 1: present {2},    mean 2      -> row 3 becomes 2
    # group 2: nothing present             -> rows 5 and 6 become 0
    scores = torch.tensor([1.0, 3.0, NAN, -5.0, 2.0, 8.0, 9.0])
    missing = torch.tensor([False, False, True, True, False, True, True])
    gi = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    filled = fill_with_group_mean(scores, missing, gi)
    assert filled.tolist() == [1.0, 3.0, 2.0, 2.0, 2.0, 0.0, 0.0]
    assert filled.dtype == scores.dtype
    # the filled rows move no group mean: group 0 is still (1 + 3 + 2) / 3 = 2 = mean of {1, 3}
    assert filled[:3].mean().item() == 2.0


def test_fill_with_group_mean_without_missing_rows_is_the_identity():
    scores = torch.tensor([0.25, -1.0, 4.0])
    out = fill_with_group_mean(scores, torch.zeros(3, dtype=torch.bool), torch.tensor([2, 0, 2]))
    assert torch.equal(out, scores)


def test_fill_with_group_mean_ids_need_not_be_contiguous():
    # group 9 = rows 0, 2: present {0.5}; group 4 = rows 1, 3: present {1.0, 2.0}, mean 1.5
    scores = torch.tensor([0.5, 1.0, 7.0, 2.0, 6.0])
    missing = torch.tensor([False, False, True, False, True])
    out = fill_with_group_mean(scores, missing, torch.tensor([9, 4, 9, 4, 4]))
    assert out.tolist() == [0.5, 1.0, 0.5, 2.0, 1.5]


# ---------------------------------------------------------------------------------------------
# varied_group_rows


def test_varied_group_rows_hand_values():
    # group 0 = {1, 1} all equal -> False; group 1 = {0, 1} -> True;
    # group 2 = {0.5, 0.5} -> False; group 3 = {2} (one row) -> False
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    gi = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    keep = varied_group_rows(scores, gi)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, True, True, False, False, False]
    # the fraction of dropped groups is the diagnostic's (3 of 4 all-equal)
    assert zero_variance_group_fraction(scores, gi).item() == 0.75


# ---------------------------------------------------------------------------------------------
# invariance: rows in any order


def test_row_order_does_not_matter():
    # Dyadic scores (multiples of 1/4) make every group sum exact, so a permutation of the rows
    # permutes the outputs bit for bit.
    gen = torch.Generator().manual_seed(0)
    gi = torch.tensor([3, 0, 3, 1, 0, 1, 3, 5, 5, 0])
    scores = torch.randint(-8, 9, (10,), generator=gen).float() / 4
    scores[7] = scores[8]  # group 5 all equal
    missing = torch.tensor([False, True, False, True, False, True, True, False, False, False])
    filled = fill_with_group_mean(scores, missing, gi)
    keep = varied_group_rows(scores, gi)
    for trial in range(3):
        perm = torch.randperm(10, generator=gen)
        assert torch.equal(fill_with_group_mean(scores[perm], missing[perm], gi[perm]), filled[perm]), trial
        assert torch.equal(varied_group_rows(scores[perm], gi[perm]), keep[perm]), trial
        centered, std, size = group_mean_std(scores, gi)
        centered_p, std_p, size_p = group_mean_std(scores[perm], gi[perm])
        assert torch.equal(centered_p, centered[perm]) and torch.equal(size_p, size[perm])
        torch.testing.assert_close(std_p, std[perm], rtol=0, atol=1e-7)
