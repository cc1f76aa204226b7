"""The train/inference mismatch in the loop: its metrics, and truncated importance sampling
(``rollout.is_correction``; Yao et al. 2025) applied to the policy loss.

The sampler's log-probs are shifted by a known amount after generation, so the mismatch the loop
sees is known exactly: the HF engine's own log-probs agree with the trainer's to ~1e-6."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.run import Run

pytestmark = pytest.mark.integration


@pytest.fixture
def make_config(make_config):
    """The tiny runs of tests/training.py with every row forwarded: these tests read the
    forward's metrics over the whole batch, and a group that scored alike would be skipped."""

    def factory(name: str = "run", **sections):
        optim = {"skip_zero_advantage_rows": False, **sections.pop("optim", {})}
        return make_config(name, optim=optim, **sections)

    return factory


def _shift_sampler(run: Run, shift_of_row) -> None:
    """Make the engine report ``sampler_logprobs + shift_of_row(i)`` on the valid tokens of row i."""
    generate = run.trainer.engine.generate

    def shifted(*args, **kwargs):
        rollout = generate(*args, **kwargs)
        shift = torch.tensor([shift_of_row(i) for i in range(rollout.batch_size)])[:, None]
        rollout.sampler_logprobs = torch.where(
            rollout.response_mask > 0, rollout.sampler_logprobs + shift, 0.0
        )
        run.trainer._last_rollout = rollout
        return rollout

    run.trainer.engine.generate = shifted


def test_mismatch_metrics_read_a_known_shift(make_config):
    # Sampler log-probs lowered by 0.25 on every valid token: trainer - sampler = +0.25 (+ ~1e-6),
    # so the mean and max absolute difference are 0.25, and a sequence of n tokens has the ratio
    # exp(0.25 n): its min / max over the batch come from the shortest / longest response.
    run = Run(make_config())
    _shift_sampler(run, lambda _i: -0.25)
    m = run.trainer.step()
    lengths = run.trainer._last_rollout.response_mask.sum(-1)
    assert m["mismatch/logprob_abs_mean"] == pytest.approx(0.25, abs=1e-4)
    assert m["mismatch/logprob_abs_max"] == pytest.approx(0.25, abs=1e-4)
    assert m["mismatch/seq_ratio_min"] == pytest.approx(math.exp(0.25 * lengths.min().item()), rel=1e-3)
    assert m["mismatch/seq_ratio_max"] == pytest.approx(math.exp(0.25 * lengths.max().item()), rel=1e-3)
    assert m["mismatch/seq_log_ratio_std"] == pytest.approx(0.25 * lengths.std().item(), abs=1e-3)
    assert "mismatch/is_weight_mean" not in m  # no correction asked for


def test_no_shift_means_no_mismatch_and_no_correction_effect(make_config):
    # The HF engine's log-probs are the trainer's (same model, fp32): the mismatch is ~0 and a
    # token-level correction changes nothing (every weight is 1 within 1e-5).
    plain = Run(make_config("plain")).trainer.step()
    corrected = Run(make_config("tis", rollout={"is_correction": "token"})).trainer.step()
    assert plain["mismatch/logprob_abs_max"] < 1e-4
    assert corrected["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert corrected["mismatch/is_capped_frac"] == 0.0
    assert corrected["policy/loss"] == pytest.approx(plain["policy/loss"], rel=1e-4, abs=1e-7)


def test_token_truncation_caps_the_weight(make_config):
    # Sampler 1.0 nat below the trainer on every token: w = e^1 = 2.72 > cap 2, so every weight
    # is truncated to exactly 2 and the on-policy loss (ratio 1) is exactly twice the plain one.
    plain = Run(make_config("plain"))
    _shift_sampler(plain, lambda _i: -1.0)
    tis = Run(make_config("tis", rollout={"is_correction": "token", "is_cap": 2.0}))
    _shift_sampler(tis, lambda _i: -1.0)
    a, b = plain.trainer.step(), tis.trainer.step()
    assert b["mismatch/is_weight_mean"] == pytest.approx(2.0, abs=1e-5)
    assert b["mismatch/is_capped_frac"] == 1.0
    assert b["policy/loss"] == pytest.approx(2.0 * a["policy/loss"], rel=1e-4)


def test_mask_mode_drops_every_token_above_the_cap_so_nothing_moves(make_config):
    # Every token's weight e^1 exceeds the cap: mask mode zeroes the whole policy loss, the
    # gradient is exactly 0, and AdamW's first step with a zero gradient leaves every weight as is.
    run = Run(make_config(rollout={"is_correction": "token", "is_mode": "mask"}))
    _shift_sampler(run, lambda _i: -1.0)
    before = {k: v.clone() for k, v in run.trainer.policy.state_dict().items()}
    m = run.trainer.step()
    assert m["mismatch/is_weight_mean"] == 0.0
    assert m["mismatch/is_capped_frac"] == 1.0
    assert m["policy/loss"] == 0.0
    for k, v in run.trainer.policy.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_sequence_level_weights_are_the_product_of_token_ratios(make_config):
    # Row 0's sampler is 0.05 nat low per token, every other row exact: row 0's sequence ratio is
    # exp(0.05 n0) (n0 <= 6 tokens -> <= 1.35, under the cap 2), applied to each of its tokens;
    # the other rows get weight 1. The token-weighted mean weight is therefore
    # (n0 exp(0.05 n0) + (N - n0)) / N with N the batch's valid tokens.
    run = Run(make_config(rollout={"is_correction": "sequence"}))
    _shift_sampler(run, lambda i: -0.05 if i == 0 else 0.0)
    m = run.trainer.step()
    lengths = run.trainer._last_rollout.response_mask.sum(-1)
    n0, total = lengths[0].item(), lengths.sum().item()
    expected = (n0 * math.exp(0.05 * n0) + (total - n0)) / total
    assert m["mismatch/is_weight_mean"] == pytest.approx(expected, abs=1e-5)
    assert m["mismatch/is_capped_frac"] == 0.0


def test_time_split_is_reported(make_config):
    m = Run(make_config(kl={"placement": "loss", "beta": 0.1})).trainer.step()
    for key in ("generation", "ref_logprobs", "old_logprobs", "forward", "backward", "optimizer"):
        assert m[f"time/{key}_s"] >= 0.0, key
    assert m["time/ref_logprobs_s"] > 0.0
    assert m["time/old_logprobs_s"] == 0.0  # exactly on-policy: no old-log-prob pass
    assert "time/weight_sync_s" not in m  # the hf engine samples from the live model


def test_a_token_the_trainer_cannot_produce_leaves_the_loss_and_is_counted(make_config):
    # A sampled token outside the trainer's top-k/top-p set has log-prob -inf in the trainer; the
    # step must drop that one token (and count it), not turn the whole loss into NaN and skip.
    run = Run(make_config())
    real = run.trainer.policy_step.forward

    def one_impossible_token(model, rollout, **kwargs):
        lp, ent = real(model, rollout, **kwargs)
        if lp.requires_grad:  # the training forward
            hole = torch.zeros_like(lp, dtype=torch.bool)
            hole[0, 0] = True  # row 0's first token is always valid
            lp = torch.where(hole, torch.full_like(lp, -math.inf), lp)
        return lp, ent

    run.trainer.policy_step.forward = one_impossible_token
    m = run.trainer.step()
    assert m["policy/nonfinite_tokens"] == 1
    assert m["optim/steps"] == 1 and m["optim/skipped_nonfinite"] == 0
    assert math.isfinite(m["policy/loss"])
