"""Score normalisation (``reward.normalize``): a fixed offset from the initial policy's samples,
and running mean/std, worked by hand."""

from __future__ import annotations

import pytest
import torch

from policygrad.rewards.normalize import RewardNormalizer

pytestmark = pytest.mark.unit


def test_fixed_offset_makes_the_initial_samples_average_zero():
    norm = RewardNormalizer("fixed_offset")
    # first batch [1, 2, 3, (9 invalid)]: offset = mean of the valid scores = 2
    out = norm(torch.tensor([1.0, 2.0, 3.0, 9.0]), torch.tensor([True, True, True, False]))
    assert out.tolist() == [-1.0, 0.0, 1.0, 7.0]
    assert norm.offset == 2.0
    # later batches keep the same offset
    assert norm(torch.tensor([5.0, 2.0])).tolist() == [3.0, 0.0]
    clipped = RewardNormalizer("fixed_offset", clip=0.5)
    assert clipped(torch.tensor([1.0, 2.0, 3.0])).tolist() == [-0.5, 0.0, 0.5]


def test_running_mean_std_hand_worked():
    norm = RewardNormalizer("running", eps=0.0 + 1e-12)
    # batch 1 [1, 2, 3]: mean 2, population var 2/3, std 0.81650: -> [-1.22474, 0, 1.22474]
    out = norm(torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(out, torch.tensor([-1.2247449, 0.0, 1.2247449]), rtol=0, atol=1e-6)
    # batch 2 [5]: over 1, 2, 3, 5: mean 2.75, squared deviations 3.0625 + 0.5625 + 0.0625 + 5.0625
    # = 8.75, var 2.1875, std 1.4790199: (5 - 2.75) / 1.4790199 = 1.5212777
    out = norm(torch.tensor([5.0]))
    assert float(out[0]) == pytest.approx(1.5212777, abs=1e-6)
    assert norm.count == 4 and norm.mean == pytest.approx(2.75)
    # update=False transforms without moving the statistics
    assert float(norm(torch.tensor([2.75]), update=False)[0]) == pytest.approx(0.0, abs=1e-9)
    assert norm.count == 4
    # state round trip
    other = RewardNormalizer("running")
    other.load_state_dict(norm.state_dict())
    assert other.state_dict() == norm.state_dict()
    with pytest.raises(ValueError, match="unknown reward normalisation 'z'"):
        RewardNormalizer("z")
