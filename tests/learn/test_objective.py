"""The policy loss the trainer builds from the config: which options the registered loss actually
receives (only those the user set, the rest the paper's defaults), and the gradient and clip
fraction those options give on hand-worked ratios.

Each test runs one real step of a tiny run, recording the keyword options of every policy-loss
call (bound to the loss's signature, so the defaults it fell back to are visible), then feeds the
trainer's own objective (its loss with its options, reduced by its aggregation) hand-made ratios.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from policygrad.learn.objective import MinibatchCounts, positive_samples
from policygrad.run import Run
from policygrad.trainer import ConfigError

pytestmark = pytest.mark.integration


def _received_options(run: Run) -> dict:
    """Run one step; return the options (defaults applied) the policy loss was called with."""
    objective = run.trainer.objective
    loss_fn = objective.policy_loss
    seen = []

    def spy(logprobs, old, advantages, mask, **options):
        bound = inspect.signature(loss_fn).bind(logprobs, old, advantages, mask, **options)
        bound.apply_defaults()
        seen.append(
            {
                k: v
                for k, v in bound.arguments.items()
                if k not in ("logprobs", "old_logprobs", "advantages", "response_mask")
            }
        )
        return loss_fn(logprobs, old, advantages, mask, **options)

    objective.policy_loss = spy
    run.trainer.step()
    objective.policy_loss = loss_fn
    assert seen and all(s == seen[0] for s in seen)
    return seen[0]


def _token_gradients(run: Run, log_ratio: list[float], advantages: list[float]):
    """One row of len(log_ratio) valid tokens with old log-prob -1: the per-token gradient of the
    trainer's reduced loss w.r.t. each log-prob, and the loss's metrics."""
    old = torch.full((1, len(log_ratio)), -1.0)
    logprobs = (old + torch.tensor([log_ratio])).requires_grad_(True)
    adv = torch.tensor([advantages])
    mask = torch.ones_like(old)
    objective = run.trainer.objective
    loss_matrix, metrics = objective.policy_loss(logprobs, old, adv, mask, **objective.loss_options)
    objective.reduce(loss_matrix, mask, MinibatchCounts.of(mask)).backward()
    return logprobs.grad[0], {k: float(v) for k, v in metrics.items()}


def test_gspo_trains_with_its_papers_band(make_config):
    run = Run(make_config(loss={"policy_loss": "gspo"}))
    assert run.trainer.objective.loss_options == {}  # nothing set: nothing passed
    assert _received_options(run) == {"clip_low": 3e-4, "clip_high": 4e-4}
    # Two tokens, each with log-ratio log(1.01005), A = +1: the sequence ratio s = 1.01005 is above
    # 1 + 4e-4, so the sequence is clipped: no gradient, clipfrac 1. (With a 0.2 band, as before
    # the loss declared its options, s is inside it and each token's gradient is
    # -A s / 2 = -0.505 under seq-mean-token-mean.)
    grad, metrics = _token_gradients(run, [math.log(1.01005)] * 2, [1.0, 1.0])
    assert torch.equal(grad, torch.zeros(2)) and metrics["clipfrac"] == 1.0
    wide = Run(make_config("wide", loss={"policy_loss": "gspo", "clip_low": 0.2, "clip_high": 0.2}))
    assert _received_options(wide) == {"clip_low": 0.2, "clip_high": 0.2}
    grad, metrics = _token_gradients(wide, [math.log(1.01005)] * 2, [1.0, 1.0])
    torch.testing.assert_close(grad, torch.full((2,), -1.01005 / 2), rtol=0, atol=1e-6)
    assert metrics["clipfrac"] == 0.0


def test_gspo_with_a_null_clip_keeps_its_default(make_config):
    # null means "not set": GSPO keeps 3e-4 (it used to receive None and fail at its first step).
    run = Run(make_config(loss={"policy_loss": "gspo", "clip_low": None}))
    assert _received_options(run)["clip_low"] == 3e-4


def test_cispo_has_no_lower_bound(make_config):
    run = Run(make_config(loss={"policy_loss": "cispo"}))
    assert _received_options(run) == {"clip_low": None, "clip_high": 0.28}
    # Ratios [0.5, 1, 1.5], A = +1: weights sg(clip(r, -, 1.28)) = [0.5, 1, 1.28]; the loss is
    # -w A log pi per token, token-mean over 3 tokens (grpo preset: seq-mean-token-mean, one row),
    # so d loss / d log pi = -w / 3. Every token keeps a gradient.
    grad, metrics = _token_gradients(run, [math.log(0.5), 0.0, math.log(1.5)], [1.0, 1.0, 1.0])
    torch.testing.assert_close(grad * 3, -torch.tensor([0.5, 1.0, 1.28]), rtol=0, atol=1e-6)
    assert metrics["clipfrac_low"] == 0.0 and metrics["clipfrac_high"] == pytest.approx(1 / 3)


def test_cispo_upper_bound_can_be_removed_explicitly(make_config):
    run = Run(make_config(loss={"policy_loss": "cispo", "options": {"clip_high": None}}))
    assert _received_options(run) == {"clip_low": None, "clip_high": None}
    grad, _ = _token_gradients(run, [math.log(0.5), math.log(1.5)], [1.0, 1.0])
    torch.testing.assert_close(grad * 2, -torch.tensor([0.5, 1.5]), rtol=0, atol=1e-6)


def test_ppo_defaults_and_dual_clip(make_config):
    plain = Run(make_config("plain"))
    assert _received_options(plain) == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None}
    run = Run(make_config(loss={"dual_clip": 3.0}))
    assert _received_options(run) == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0}
    # A = -1 on every token, ratios [0.5, 2, 4]: r = 0.5 < 1 - 0.2 is clipped (no gradient);
    # r = 2 is unclipped: d(-A r)/d log pi = r = 2; r = 4 > c = 3 sits on the dual clip's constant
    # -c A = 3 (no gradient). seq-mean-token-mean over one row of 3 tokens divides by 3.
    grad, metrics = _token_gradients(run, [math.log(0.5), math.log(2.0), math.log(4.0)], [-1.0] * 3)
    torch.testing.assert_close(grad, torch.tensor([0.0, 2 / 3, 0.0]), rtol=0, atol=1e-6)
    assert metrics["clipfrac_low"] == pytest.approx(1 / 3) and metrics["clipfrac_dual"] == pytest.approx(
        1 / 3
    )
    # Without the dual clip the r = 4 token keeps its gradient 4 / 3.
    grad, _ = _token_gradients(plain, [math.log(0.5), math.log(2.0), math.log(4.0)], [-1.0] * 3)
    torch.testing.assert_close(grad, torch.tensor([0.0, 2 / 3, 4 / 3]), rtol=0, atol=1e-6)


def test_vanilla_takes_no_options(make_config):
    run = Run(make_config(loss={"policy_loss": "vanilla"}))
    assert _received_options(run) == {}
    # -A log pi per token, 3 tokens: gradients -A / 3 whatever the ratio.
    grad, metrics = _token_gradients(run, [0.3, -0.2, 0.0], [1.0, -2.0, 0.5])
    torch.testing.assert_close(grad, torch.tensor([-1 / 3, 2 / 3, -0.5 / 3]), rtol=0, atol=1e-6)
    assert metrics["clipfrac"] == 0.0
    with pytest.raises(ConfigError, match="policy loss 'vanilla' has no option 'clip_low'"):
        make_config("bad", loss={"policy_loss": "vanilla", "clip_low": 0.2})


def test_positive_example_lm_loss_by_hand(make_config):
    # VAPO's positive-example LM loss with coefficient 0.1 on two rows of two tokens, row 0
    # positive. Zero advantages make the vanilla policy loss 0, so the loss is
    #   0.1 x (-(-1) - (-2)) / 2 positive tokens = 0.15,
    # with gradient -0.1 / 2 = -0.05 on each positive token and 0 on the others. Split into one
    # micro-batch per row with the minibatch's counts, the two losses add up to the same 0.15.
    run = Run(make_config(loss={"policy_loss": "vanilla", "positive_lm_coef": 0.1}))
    objective = run.trainer.objective
    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], requires_grad=True)
    mask, positive = torch.ones(2, 2), torch.tensor([1.0, 0.0])
    counts = MinibatchCounts.of(mask, positive)
    assert int(counts.num_positive_tokens) == 2

    def micro(rows):
        return SimpleNamespace(
            loss_mask=mask[rows],
            advantages=torch.zeros(len(rows), 2),
            ref_logprobs=None,
            cov_selected=None,
            positive=positive[rows],
            sample_tokens=None,
        )

    loss, metrics, _ = objective(logprobs, torch.zeros(2, 2), logprobs.detach(), micro([0, 1]), counts)
    assert float(loss.detach()) == pytest.approx(0.15, abs=1e-7)
    assert float(metrics["positive_lm_nll"]) == pytest.approx(1.5) and float(metrics["positive_frac"]) == 0.5
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.05, -0.05], [0.0, 0.0]]), rtol=0, atol=1e-7)
    parts = [
        objective(logprobs[[r]], torch.zeros(1, 2), logprobs[[r]].detach(), micro([r]), counts)[0]
        for r in (0, 1)
    ]
    assert float(sum(parts).detach()) == pytest.approx(0.15, abs=1e-7)


def test_positive_samples_are_the_best_valid_ones():
    # scores 1, 0, 1 (invalid), 0.5: the best valid score is 1 (row 0 only), and 0 < 1, so row 0.
    scores, valid = torch.tensor([1.0, 0.0, 1.0, 0.5]), torch.tensor([True, True, False, True])
    assert positive_samples(scores, valid).tolist() == [1.0, 0.0, 0.0, 0.0]
    # a 0/1 verifier: every correct sample
    assert positive_samples(torch.tensor([1.0, 0.0, 1.0]), torch.ones(3, dtype=torch.bool)).tolist() == [
        1,
        0,
        1,
    ]
    # integer scores work as floats
    assert positive_samples(torch.tensor([0, 1, 1, 0]), torch.ones(4, dtype=torch.bool)).tolist() == [
        0,
        1,
        1,
        0,
    ]
    # all equal: nothing is better than anything, no positive sample
    assert positive_samples(torch.zeros(4), torch.ones(4, dtype=torch.bool)).tolist() == [0.0] * 4


def test_an_entropy_target_the_policy_cannot_reach_is_refused_and_the_coefficient_capped(
    make_config, caplog
):
    # Before: loss.entropy_target=1e9 was accepted and the adaptive coefficient rose every step.
    # The tiny model samples from 100 ids: no distribution over them has entropy above ln 100.
    with pytest.raises(ConfigError) as info:
        Run(make_config("unreachable", loss={"entropy_target": 4.61}))
    assert str(info.value) == (
        "loss.entropy_target=4.61 is not below ln V = 4.605 nats, the entropy of the uniform distribution "
        "over the model's 100 tokens and the most a token's distribution can have: the policy never reaches "
        "it and the adaptive coefficient would rise every step; give a target below 4.605 (Skywork-OR1 uses "
        "0.2)"
    )
    # A target the policy is below: after one step the coefficient is 100 (99.5 + 1, capped), said once.
    loss = {"entropy_target": 4.6, "entropy_coef": 99.5, "entropy_coef_delta": 1.0}
    run = Run(make_config("capped", steps=1, loss=loss))
    try:
        with caplog.at_level("WARNING", logger="policygrad"):
            run.train()
    finally:
        run.close()
    assert run.trainer.entropy_ctl.coef == 100.0
    capped = [r.getMessage() for r in caplog.records if "reached its cap" in r.getMessage()]
    assert len(capped) == 1 and "below loss.entropy_target=4.6; lower the target" in capped[0]


def test_entropy_options_are_checked(make_config):
    with pytest.raises(ConfigError, match="loss.entropy_target must be > 0"):
        make_config(loss={"entropy_target": 0.0})
    with pytest.raises(
        ConfigError, match="loss.entropy_coef_delta=0.01 has no effect without loss.entropy_target"
    ):
        make_config(loss={"entropy_coef_delta": 0.01})
    with pytest.raises(ConfigError, match="loss.positive_lm_coef must be >= 0"):
        make_config(loss={"positive_lm_coef": -0.1})
    with pytest.raises(ConfigError, match="kl_cov_ratio|ratio must be in"):
        make_config(loss={"policy_loss": "kl_cov", "options": {"kl_cov_ratio": 2.0}})


def test_a_sample_spread_over_rows_counts_once_in_num_seqs():
    # Rows: an episode's last segment (2 loss tokens) and its earlier segment (2 more: the episode
    # has 4), a plain sample (3), a row with no loss token. Shares 2/4 + 2/4 + 3/3 = 2 sequences.
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]])
    counts = MinibatchCounts.of(mask, sample_tokens=torch.tensor([4.0, 4.0, 3.0, 0.0]))
    assert (counts.num_tokens.item(), counts.num_seqs.item()) == (7.0, 2.0)
    # A minibatch holding only the earlier segment counts half a sequence.
    half = MinibatchCounts.of(mask[1:2], sample_tokens=torch.tensor([4.0]))
    assert half.num_seqs.item() == 0.5
    plain = MinibatchCounts.of(mask)  # without sample_tokens: rows with a loss token, as ever
    assert plain.num_seqs.item() == 3 and plain.num_seqs.dtype == torch.int64
