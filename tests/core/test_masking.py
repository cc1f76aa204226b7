"""Tests of policygrad.core.masking: masked statistics and loss aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.core.masking import (
    AGGREGATION_MODES,
    aggregate,
    aggregation_counts,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

pytestmark = pytest.mark.unit

NAN = float("nan")
INF = float("inf")


# ---------------------------------------------------------------------------------------------
# masked_sum / masked_mean
# ---------------------------------------------------------------------------------------------


def test_masked_sum_and_mean_hand_values_with_garbage_under_the_mask():
    x = torch.tensor([[1.0, 2.0, NAN, INF], [4.0, -INF, 6.0, 8.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]])
    # valid entries: row 0 -> 1, 2 ; row 1 -> 4, 6, 8
    assert masked_sum(x, mask).item() == 21.0  # 1 + 2 + 4 + 6 + 8
    assert masked_mean(x, mask).item() == pytest.approx(21.0 / 5, abs=1e-6)  # float32
    assert torch.equal(masked_sum(x, mask, dim=-1), torch.tensor([3.0, 18.0]))
    assert torch.equal(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 6.0]))
    # column means: col0 (1+4)/2, col1 2/1, col2 6/1, col3 8/1
    assert torch.equal(masked_mean(x, mask, dim=0), torch.tensor([2.5, 2.0, 6.0, 8.0]))


def test_masked_mean_accepts_bool_int_and_float_masks_alike():
    x = torch.tensor([3.0, 5.0, 100.0])
    expected = torch.tensor(4.0)  # (3 + 5) / 2
    for mask in (torch.tensor([True, True, False]), torch.tensor([1, 1, 0]), torch.tensor([1.0, 1.0, 0.0])):
        assert torch.equal(masked_mean(x, mask), expected)


def test_masked_mean_of_an_empty_selection_is_zero_not_nan():
    x = torch.tensor([[1.0, NAN], [2.0, 3.0]])
    mask = torch.tensor([[0, 0], [1, 1]])
    assert torch.equal(masked_mean(x, mask, dim=-1), torch.tensor([0.0, 2.5]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_nan_under_the_mask_reaches_neither_value_nor_gradient():
    x = torch.tensor([[1.0, 3.0, NAN]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    masked_mean(x, mask).backward()
    # d/dx of (x0 + x1) / 2 is 0.5 on valid entries, exactly 0 on the masked one
    assert torch.equal(x.grad, torch.tensor([[0.5, 0.5, 0.0]]))


def test_mask_shape_mismatch_names_the_argument():
    with pytest.raises(ValueError, match="mask"):
        masked_sum(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask"):
        masked_mean(torch.zeros(2, 3), torch.ones(3))
    with pytest.raises(TypeError, match="mask"):
        masked_mean(torch.zeros(2), [1, 1])


# ---------------------------------------------------------------------------------------------
# masked_var / masked_whiten
# ---------------------------------------------------------------------------------------------


def test_masked_var_hand_values():
    x = torch.tensor([[1.0, 2.0, NAN], [4.0, 1e30, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # valid 1, 2, 4: mean 7/3, deviations -4/3, -1/3, 5/3, squares sum (16 + 1 + 25)/9 = 14/3
    assert masked_var(x, mask).item() == pytest.approx(14 / 3 / 2, abs=1e-12)  # unbiased: / (n-1)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(14 / 3 / 3, abs=1e-12)


def test_masked_var_with_too_few_entries_raises():
    x = torch.tensor([5.0, 7.0])
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, torch.tensor([1, 0]))
    assert masked_var(x, torch.tensor([1, 0]), unbiased=False).item() == 0.0
    with pytest.raises(ValueError, match="at least 1"):
        masked_var(x, torch.tensor([0, 0]), unbiased=False)


def test_whitening_ignores_padding_bug_report_case():
    # Bug-report case 3: x = [[1, 3, 0, 0]], mask [[1, 1, 0, 0]].
    # valid mean 2, population variance ((1-2)^2 + (3-2)^2) / 2 = 1 -> [-1, 1].
    # A mean over padding would give mean 1, std sqrt(2) (population over 4) -> [0, 1.414].
    x = torch.tensor([[1.0, 3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0]])
    out = masked_whiten(x, mask, unbiased=False)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 1.0, 0.0, 0.0]]), rtol=0, atol=1e-7)
    # Default (unbiased) variance: ((-1)^2 + 1^2) / (2 - 1) = 2 -> [-1/sqrt 2, 1/sqrt 2]
    out = masked_whiten(x, mask)
    h = 1 / math.sqrt(2)
    torch.testing.assert_close(out, torch.tensor([[-h, h, 0.0, 0.0]]), rtol=0, atol=1e-7)


def test_whitening_without_mean_shift_keeps_the_mean():
    # valid [2, 6]: mean 4, population std 2 -> centred [-1, 1]; shift_mean=False adds 4 back.
    x = torch.tensor([[2.0, 6.0, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    out = masked_whiten(x, mask, shift_mean=False, unbiased=False, eps=0.0)
    assert torch.equal(out, torch.tensor([[3.0, 5.0, 0.0]], dtype=torch.float64))


def test_whitening_a_constant_input_gives_exact_zeros():
    # 0.9 three times in float32: the computed mean is not exactly 0.9 (checked below), but the
    # variance must be 0 and the whitened values exactly 0, not rounding error / sqrt(eps).
    x = torch.tensor([[0.9, 0.9], [0.9, 123.0]], dtype=torch.float32)
    mask = torch.tensor([[1, 1], [1, 0]])
    assert (x[0, 0] - masked_mean(x, mask)).item() != 0.0  # the premise
    assert torch.equal(masked_whiten(x, mask), torch.zeros(2, 2))
    assert torch.equal(
        masked_whiten(x, mask, shift_mean=False), torch.where(mask.bool(), masked_mean(x, mask), 0)
    )
    assert masked_var(x, mask).item() == 0.0


def test_whitened_valid_entries_have_zero_mean_and_unit_variance():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 3 + 2
    mask = torch.rand(5, 7, generator=gen) < 0.6
    x_garbage = torch.where(mask, x, torch.full_like(x, NAN))
    out = masked_whiten(x_garbage, mask, eps=0.0)
    assert abs(masked_mean(out, mask).item()) < 1e-12
    assert masked_var(out, mask).item() == pytest.approx(1.0, abs=1e-12)
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum()), dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# aggregate
# ---------------------------------------------------------------------------------------------


def test_token_mean_with_global_count_bug_report_case():
    # Bug-report case 1: micro-batch 1 = sequence A (1 valid token, loss -1); micro-batch 2 =
    # sequence B (3 valid tokens, loss +1 each). Full batch token mean: (-1 + 3) / 4 = 0.5.
    mb1 = torch.tensor([[-1.0, 0.0, 0.0]])
    m1 = torch.tensor([[1, 0, 0]])
    mb2 = torch.tensor([[1.0, 1.0, 1.0]])
    m2 = torch.tensor([[1, 1, 1]])
    total = aggregate(mb1, m1, "token-mean", num_tokens=4) + aggregate(mb2, m2, "token-mean", num_tokens=4)
    assert total.item() == pytest.approx(0.5, abs=1e-7)  # -1/4 + 3/4
    # The per-micro-batch normaliser is the bug: -1/1 and 3/3 average to 0.0.
    per_mb = (aggregate(mb1, m1, "token-mean") + aggregate(mb2, m2, "token-mean")) / 2
    assert per_mb.item() == 0.0


def test_modes_on_different_lengths_bug_report_case():
    # Bug-report case 2: advantages [0.5, -0.5], lengths 2 and 6, per-token loss = -A, max_len 8.
    # token losses: seq 0 -> -0.5 x 2 (sum -1), seq 1 -> +0.5 x 6 (sum 3).
    loss = torch.tensor([[-0.5] * 2 + [NAN] * 6, [0.5] * 6 + [INF] * 2])
    mask = torch.tensor([[1] * 2 + [0] * 6, [1] * 6 + [0] * 2])
    expected = {
        "seq-mean-token-mean": 0.0,  # (-0.5 + 0.5) / 2
        "token-mean": 0.25,  # (-1 + 3) / 8
        "seq-mean-token-sum-norm": 0.125,  # (-1 + 3) / (2 * 8)
        "seq-mean-token-sum": 1.0,  # (-1 + 3) / 2
        "token-sum": 2.0,  # -1 + 3
    }
    assert set(expected) == set(AGGREGATION_MODES)
    for mode, value in expected.items():
        assert aggregate(loss, mask, mode, max_len=8).item() == pytest.approx(value, abs=1e-7), mode


def test_seq_mean_token_sum_norm_defaults_max_len_to_t():
    loss = torch.tensor([[1.0, 2.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    # (1 + 2 + 3) / (2 sequences * T=4) = 0.75 ; with max_len=6: 6 / 12 = 0.5
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == 0.75
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", max_len=6).item() == 0.5


def test_rows_without_valid_tokens_contribute_nothing_and_are_not_counted():
    loss = torch.tensor([[2.0, 4.0], [NAN, NAN], [6.0, 0.0]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    # two real sequences: means 3 and 6; sums 6 and 6; 3 tokens in all
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == 4.5  # (3 + 6) / 2, not / 3
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == 6.0  # (6 + 6) / 2
    assert aggregate(loss, mask, "token-mean").item() == 4.0  # 12 / 3
    num_tokens, num_seqs = aggregation_counts(mask)
    assert (num_tokens.item(), num_seqs.item()) == (3, 2)
    # a batch with no valid token at all: loss 0 in every mode, and a zero (not NaN) gradient
    empty = torch.full((2, 3), NAN, requires_grad=True)
    for mode in AGGREGATION_MODES:
        out = aggregate(empty, torch.zeros(2, 3), mode)
        assert out.item() == 0.0, mode
        (grad,) = torch.autograd.grad(out, empty)
        assert torch.equal(grad, torch.zeros(2, 3)), mode


def test_gradient_of_token_mean_is_one_over_count_on_valid_tokens_only():
    loss = torch.tensor([[1.0, NAN], [2.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 1]])
    aggregate(loss, mask, "token-mean").backward()
    assert torch.equal(loss.grad, torch.tensor([[1 / 3, 0.0], [1 / 3, 1 / 3]]))


def _random_batch(seed: int, batch: int = 7, steps: int = 6):
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch, steps, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, steps + 1, (batch,), generator=gen)
    lengths[0] = steps  # at least one full row
    lengths[1] = 0  # and one padding row
    mask = (torch.arange(steps)[None, :] < lengths[:, None]).long()
    loss = torch.where(mask.bool(), loss, torch.full_like(loss, NAN))  # garbage under the mask
    return loss, mask


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batch_sum_equals_full_batch_loss_for_every_split(mode):
    for seed in range(3):
        loss, mask = _random_batch(seed)
        num_tokens, num_seqs = aggregation_counts(mask)
        counts = {"num_tokens": num_tokens, "num_seqs": num_seqs}
        full = aggregate(loss, mask, mode)
        assert math.isfinite(full.item())
        for size in range(1, loss.shape[0] + 1):
            parts = [
                aggregate(loss[i : i + size], mask[i : i + size], mode, **counts)
                for i in range(0, loss.shape[0], size)
            ]
            torch.testing.assert_close(torch.stack(parts).sum(), full, rtol=1e-12, atol=1e-12)


def test_micro_batch_gradients_sum_to_the_full_batch_gradient():
    loss, mask = _random_batch(5)
    loss = torch.nan_to_num(loss, nan=0.0).requires_grad_(True)
    num_tokens, num_seqs = aggregation_counts(mask)
    for mode in AGGREGATION_MODES:
        (full_grad,) = torch.autograd.grad(aggregate(loss, mask, mode), loss)
        split = sum(
            aggregate(loss[i : i + 3], mask[i : i + 3], mode, num_tokens=num_tokens, num_seqs=num_seqs)
            for i in range(0, loss.shape[0], 3)
        )
        (split_grad,) = torch.autograd.grad(split, loss)
        torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-12)


def test_counts_may_be_tensors_or_numbers():
    loss = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # (1 + 2 + 3) / 4 = 1.5
    assert aggregate(loss, mask, "token-mean", num_tokens=torch.tensor(4)).item() == 1.5
    assert aggregate(loss, mask, "token-mean", num_tokens=4.0).item() == 1.5
    # seq means 1.5 and 3 -> 4.5 / 3 = 1.5
    assert aggregate(loss, mask, "seq-mean-token-mean", num_seqs=torch.tensor([3])).item() == 1.5


def test_aggregate_errors_name_the_argument():
    loss = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="response_mask"):
        aggregate(loss, torch.ones(2, 4))
    with pytest.raises(ValueError, match="loss_matrix"):
        aggregate(torch.zeros(6), torch.ones(6))
    with pytest.raises(ValueError, match="token-mean, token-sum, seq-mean-token-mean"):
        aggregate(loss, torch.ones(2, 3), "sequence-mean")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(loss, torch.ones(2, 3), "token-mean", num_tokens=0)
    with pytest.raises(ValueError, match="num_seqs"):
        aggregate(loss, torch.ones(2, 3), "seq-mean-token-sum", num_seqs=torch.tensor(-1.0))
    with pytest.raises(TypeError, match="num_seqs"):
        aggregate(loss, torch.ones(2, 3), "seq-mean-token-sum", num_seqs="2")
    with pytest.raises(ValueError, match="max_len"):
        aggregate(loss, torch.ones(2, 3), "seq-mean-token-sum-norm", max_len=0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_a_sequence_split_over_rows_aggregates_as_the_unsplit_sequence(mode):
    """Sequence A (4 tokens) and B (4 tokens, then padding); A split into rows of 1 and 3 tokens
    (an episode and its earlier segment). With each row's sequence length (``seq_lengths``) and
    each row counted as its share of a sequence in ``num_seqs`` the loss is the unsplit one, in
    every mode and in any micro-batching.

    Worked by hand for seq-mean-token-mean: unsplit (1+2+3+4)/4 = 2.5 and (5+6)/2 = 5.5 (B's two
    valid tokens), mean 4.0; split: (1)/4 + (2+3+4)/4 = 2.5 as well, over 1/4 + 3/4 + 1 = 2 sequences.
    Without ``seq_lengths`` the split would give (1/1 + 9/3 + 5.5) / 3 = 3.1666..."""
    d = torch.float64
    unsplit = torch.tensor([[1.0, 2, 3, 4], [5, 6, NAN, NAN]], dtype=d)
    unsplit_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    split = torch.tensor([[1.0, NAN, NAN, NAN], [2, 3, 4, NAN], [5, 6, NAN, NAN]], dtype=d)
    split_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]])
    lengths = torch.tensor([4.0, 4.0, 2.0], dtype=d)  # each row's sequence's tokens
    shares = split_mask.sum(-1) / lengths  # 1/4, 3/4, 1
    expected = aggregate(unsplit, unsplit_mask, mode, max_len=4)
    counts = {"num_tokens": 6, "num_seqs": shares.sum(), "max_len": 4}
    got = aggregate(split, split_mask, mode, seq_lengths=lengths, **counts)
    torch.testing.assert_close(got, expected, rtol=1e-15, atol=1e-15)
    parts = [
        aggregate(split[i : i + 1], split_mask[i : i + 1], mode, seq_lengths=lengths[i : i + 1], **counts)
        for i in range(3)
    ]
    torch.testing.assert_close(torch.stack(parts).sum(), expected, rtol=1e-15, atol=1e-15)
    if mode == "seq-mean-token-mean":
        assert expected.item() == 4.0
        naive = aggregate(split, split_mask, mode)  # each row its own sequence: the bias
        assert abs(naive.item() - (1 + 3 + 5.5) / 3) < 1e-12
