"""The policy's optimizer step on a minibatch and the statistics of an update: micro-batching
does not change the step, the target-KL check takes none, and ``UpdateStats`` counts stopped,
applied and skipped steps; ``KLMeter`` is the token-weighted approx-KL."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from policygrad.config.train import load_config
from policygrad.learn.experience import Experience
from policygrad.learn.optim import OptimizerStep, StepOutcome
from policygrad.learn.update import KLMeter, PolicyStep, UpdateStats
from policygrad.parallel.distributed import Dist
from policygrad.parallel.precision import resolve_precision
from policygrad.parallel.strategy import Single
from policygrad.rollout.base import Rollout
from policygrad.trainer.build import build_objective
from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.integration

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny-model forwards on one thread (tests/conftest.py)."""


# ----------------------------------------------------------------------------- KLMeter


def test_kl_meter_is_token_weighted_and_ignores_micro_batches_without_kl():
    meter = KLMeter()
    assert meter.add({"approx_kl": 0.1}, 3.0) == 3.0
    assert meter.add({"approx_kl": 0.4}, 1.0) == 1.0
    assert meter.add({"clipfrac": 9.0}, 5.0) == 5.0  # no approx_kl: not counted
    assert meter.add({"approx_kl": 100.0}, 0.0) == 0.0  # no tokens: not counted
    # (0.1 * 3 + 0.4 * 1) / 4 = 0.175
    assert (meter.sum, meter.weight) == pytest.approx((0.7, 4.0), abs=1e-15)
    assert meter.exceeds(0.17) and not meter.exceeds(0.18)
    assert not KLMeter().exceeds(-1.0)  # nothing measured never exceeds


def test_kl_meter_over_ranks_uses_the_global_mean():
    meter = KLMeter()
    meter.add({"approx_kl": 0.1}, 1.0)
    # another rank measured approx-KL 0.5 on 3 tokens: (0.1 + 1.5) / 4 = 0.4
    other = torch.tensor([1.5, 3.0])
    assert meter.exceeds(0.39, reduce=lambda t: t + other)
    meter2 = KLMeter()
    meter2.add({"approx_kl": 0.1}, 1.0)
    assert not meter2.exceeds(0.41, reduce=lambda t: t + other)


# ----------------------------------------------------------------------------- UpdateStats


def test_record_counts_applied_skipped_and_stopped_steps():
    stats = UpdateStats()
    stats.record(StepOutcome(applied=True, grad_norm=2.0, loss=0.5, backward_s=1.0, optimizer_s=0.25))
    stats.record(StepOutcome(applied=False, grad_norm=None, loss=0.0, backward_s=0.5))  # non-finite loss
    stats.record(StepOutcome(applied=False, grad_norm=math.inf))  # non-finite norm: recorded, skipped
    stats.record(StepOutcome(stopped=True, grad_norm=None, backward_s=0.25, optimizer_s=0.0))
    assert (stats.steps, stats.skipped, stats.early_stopped) == (1, 2, True)
    assert stats.losses == [0.5] and stats.grad_norms == [2.0, math.inf]
    assert stats.timers == {"forward": 0.0, "backward": 1.75, "optimizer": 0.25}
    m = stats.metrics(target_kl=True, ptx=False, critic_lr=None)
    assert m["optim/steps"] == 1 and m["optim/skipped_nonfinite"] == 2 and m["optim/early_stopped"] == 1.0
    assert m["policy/loss"] == 0.5 and m["optim/grad_norm"] == math.inf


def test_metrics_are_token_weighted_means_and_maxima():
    stats = UpdateStats()
    stats.add_micro({"clipfrac": 0.5, "kl_loss": 1.0, "ratio_max": 1.2, "num_seqs": 7}, 1.0)
    stats.add_micro({"clipfrac": 0.0, "kl_loss": 4.0, "ratio_max": 1.1}, 3.0)
    m = stats.metrics(target_kl=False, ptx=False, critic_lr=None)
    # clipfrac (0.5 * 1 + 0 * 3) / 4 = 0.125; kl_loss (1 + 12) / 4 = 3.25; max 1.2; counts dropped.
    assert m["policy/clipfrac"] == 0.125 and m["kl/loss_term"] == 3.25 and m["policy/ratio_max"] == 1.2
    assert "policy/num_seqs" not in m and "optim/early_stopped" not in m and "ptx/loss" not in m
    assert math.isnan(m["policy/loss"]) and math.isnan(m["optim/grad_norm"])  # no step applied


def test_critic_steps_are_token_weighted():
    stats = UpdateStats()
    stats.add_critic(
        {"skipped": False, "grad_norm": 1.0, "num_tokens": 2, "vf_loss": 1.0, "vf_clipfrac": 0.0}
    )
    stats.add_critic(
        {"skipped": False, "grad_norm": 3.0, "num_tokens": 6, "vf_loss": 3.0, "vf_clipfrac": 0.5}
    )
    stats.add_critic({"skipped": True})
    stats.add_critic({})  # no critic step
    m = stats.metrics(target_kl=False, ptx=False, critic_lr=1e-4)
    # vf_loss (1 * 2 + 3 * 6) / 8 = 2.5; clipfrac 3 / 8; mean norm 2.
    assert m["critic/vf_loss"] == 2.5 and m["critic/vf_clipfrac"] == 0.375 and m["critic/grad_norm"] == 2.0
    assert (m["critic/steps"], m["critic/skipped_nonfinite"], m["critic/lr"]) == (2, 1, 1e-4)


def test_first_logprobs_are_kept_only_for_an_on_policy_update():
    rollout = _rollout(B=3, T=4)
    exp = Experience(
        rows=torch.arange(3), rollout=rollout, loss_mask=rollout.response_mask, advantages=torch.ones(3, 4)
    )
    stats = UpdateStats.for_batch(exp)
    assert stats.rollout_logprobs.shape == (3, 4) and stats.rollout_rows.tolist() == [False] * 3
    # a micro-batch trimmed to 2 columns holding rows 2 and 0
    stats.record_first_logprobs([(torch.tensor([2, 0]), torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]))])
    assert stats.rollout_rows.tolist() == [True, False, True]
    assert stats.rollout_logprobs.tolist() == [[-3.0, -4.0, 0, 0], [0, 0, 0, 0], [-1.0, -2.0, 0, 0]]
    old = torch.full((3, 4), -0.5)
    off = UpdateStats.for_batch(Experience(**{**exp.__dict__, "old_logprobs": old}))
    assert off.rollout_logprobs is old and off.rollout_rows is None
    off.record_first_logprobs([(torch.tensor([0]), torch.zeros(1, 2))])  # ignored
    assert torch.equal(off.rollout_logprobs, torch.full((3, 4), -0.5))


# ----------------------------------------------------------------------------- PolicyStep


def _rollout(B=8, P=4, T=6, seed=0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1 + (3 * r) % T for r in range(B)])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    prompt_mask = (torch.arange(P)[None, :] >= (torch.arange(B) % 2)[:, None]).long()  # some left padding
    return Rollout(
        prompt_ids=torch.randint(4, 100, (B, P), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(4, 100, (B, T), generator=g) * mask.long(),
        response_mask=mask,
        truncated=torch.zeros(B, dtype=torch.bool),
        sampler_logprobs=torch.zeros(B, T),
        group_index=torch.arange(B) // 4,
        group_size=4,
    )


def _experience(old_logprobs=None) -> Experience:
    rollout = _rollout()
    adv = torch.linspace(-1.0, 1.0, rollout.batch_size)[:, None] * rollout.response_mask
    return Experience(
        rows=torch.arange(rollout.batch_size),
        rollout=rollout,
        loss_mask=rollout.response_mask,
        advantages=adv,
        old_logprobs=old_logprobs,
    )


def _policy_step(tmp_path, micro_batch_size, *, target_kl=None, lr=1.0, **sections):
    cfg = load_config(
        None,
        {
            "model": {"name": "m"},
            "reward": {"functions": ["r.py:f"]},
            "output_dir": str(tmp_path),
            **sections,
        },
    )
    model, _ = make_tiny_llama(seed=1)
    params = list(model.parameters())
    # SGD: the weights move by lr x the gradient, so they compare the gradients themselves.
    opt = torch.optim.SGD(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _k: 1.0)
    step = OptimizerStep(opt, sched, params, max_grad_norm=1e9, device=CPU, strategy=Single(Dist()))
    return PolicyStep(
        model,
        build_objective(cfg, cfg.kl_placement),
        step,
        strategy=Single(Dist()),
        precision=resolve_precision("fp32", CPU),
        micro_batch_size=micro_batch_size,
        target_kl=target_kl,
        device=CPU,
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batching_does_not_change_the_step(tmp_path, agg):
    exp = _experience()
    whole, micro = (
        _policy_step(tmp_path, 8, loss={"agg_mode": agg}),
        _policy_step(tmp_path, 3, loss={"agg_mode": agg}),
    )
    s_whole, s_micro = UpdateStats.for_batch(exp), UpdateStats.for_batch(exp)
    first_whole = whole(exp, s_whole)
    first_micro = micro(exp, s_micro)
    assert s_whole.steps == s_micro.steps == 1
    # 8 rows in micro-batches of 3: rows 0-2, 3-5, 6-7, each the policy's log-probs before the step.
    assert [r.tolist() for r, _ in first_micro] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [r.tolist() for r, _ in first_whole] == [list(range(8))]
    # The same rows in another batch width sum in another order: log_softmax(z)_y = z_y -
    # logsumexp(z) moves by at most 2 max|dz|, and a logit (a plain matmul sum) carries REL = 1e-5
    # of the logits' scale (measured up to 4.8e-7 with ATEN_CPU_CAPABILITY=default).
    with torch.no_grad():
        ids = torch.cat([exp.rollout.prompt_ids, exp.rollout.response_ids], 1)
        atol = 2 * 1e-5 * float(make_tiny_llama(seed=1)[0](ids).logits.abs().max())
    for rows, lp in first_micro:
        assert torch.allclose(lp, first_whole[0][1][rows, : lp.shape[1]], rtol=0, atol=atol)
    assert s_micro.grad_norms[0] == pytest.approx(s_whole.grad_norms[0], rel=1e-5)
    assert s_micro.losses[0] == pytest.approx(s_whole.losses[0], rel=1e-5, abs=1e-7)
    # the gradient norm is O(1) and lr is 1, so the weights move O(1e-1); they agree to float32 sums.
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(whole.policy.parameters(), make_tiny_llama(seed=1)[0].parameters())
    )
    assert moved > 1e-3
    for a, b in zip(whole.policy.parameters(), micro.policy.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_an_approx_kl_above_the_target_takes_no_step(tmp_path):
    step = _policy_step(tmp_path, 4, target_kl=1e-3)
    before = copy.deepcopy(step.policy.state_dict())
    # old log-probs far from the policy's (-0.1 against about -log(100) = -4.6): approx-KL >> 1e-3
    exp = _experience(old_logprobs=torch.full((8, 6), -0.1))
    stats = UpdateStats.for_batch(exp)
    assert step(exp, stats) == []  # off-policy: no first log-probs
    assert stats.early_stopped and stats.steps == 0 and stats.skipped == 0
    assert all(torch.equal(v, step.policy.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in step.policy.parameters())
    assert stats.metrics(target_kl=True, ptx=False, critic_lr=None)["optim/early_stopped"] == 1.0


def test_a_target_kl_that_holds_takes_the_step(tmp_path):
    step = _policy_step(tmp_path, 4, target_kl=1.0)
    stats = UpdateStats.for_batch(exp := _experience())
    first = step(exp, stats)  # on-policy: approx-KL is exactly 0
    assert not stats.early_stopped and stats.steps == 1 and len(first) == 2


# ----------------------------------------------------------------------------- rows without gradient


def _half_zero_experience(dtype=torch.float64) -> Experience:
    """Two groups of 4: group 0 scored alike (every advantage 0), group 1 did not."""
    rollout = _rollout()
    adv = (
        torch.tensor([0.0, 0.0, 0.0, 0.0, -1.5, 0.5, 0.5, 0.5], dtype=dtype)[:, None] * rollout.response_mask
    )
    return Experience(
        rows=torch.arange(rollout.batch_size),
        rollout=rollout,
        loss_mask=rollout.response_mask.to(dtype),
        advantages=adv,
    )


def _step_f64(tmp_path, *, skip, optimizer="sgd", **sections):
    step = _policy_step(tmp_path, 3, **sections)
    step.policy.double()
    params = list(step.policy.parameters())
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    else:
        opt = torch.optim.SGD(params, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _k: 1.0)
    step.step = OptimizerStep(opt, sched, params, max_grad_norm=1e9, device=CPU, strategy=Single(Dist()))
    step.skip_zero_advantage = skip
    return step


@pytest.mark.parametrize("loss", ["ppo", "vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_skipping_the_rows_whose_advantages_are_all_zero_leaves_the_step(tmp_path, loss, agg):
    exp = _half_zero_experience()
    sections = {"loss": {"policy_loss": loss, "agg_mode": agg}}
    full, skipping = _step_f64(tmp_path, skip=False, **sections), _step_f64(tmp_path, skip=True, **sections)
    s_full, s_skip = UpdateStats.for_batch(exp), UpdateStats.for_batch(exp)
    full(exp, s_full)
    first = skipping(exp, s_skip)
    # Only group 1 was forwarded; the normalisers still counted group 0's rows and tokens, so the
    # loss and the gradient are the same: exact math, float64 sums in another order (1e-12 of
    # weights that moved O(1e-2) with lr 1).
    assert [r.tolist() for r, _ in first] == [[4, 5, 6], [7]]
    assert (s_full.rows, s_skip.rows) == ([8, 0], [8, 4])
    assert s_skip.metrics(target_kl=False, ptx=False, critic_lr=None)["optim/skipped_rows_frac"] == 0.5
    assert s_skip.losses[0] == pytest.approx(s_full.losses[0], rel=1e-12, abs=1e-15)
    assert s_skip.grad_norms[0] == pytest.approx(s_full.grad_norms[0], rel=1e-12)
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(full.policy.parameters(), make_tiny_llama(seed=1)[0].double().parameters())
    )
    assert moved > 1e-3
    for a, b in zip(full.policy.parameters(), skipping.policy.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_a_batch_without_gradient_skips_every_row_and_still_steps_adamw(tmp_path):
    flat = _half_zero_experience()
    flat = dataclasses.replace(flat, advantages=torch.zeros_like(flat.advantages))
    # every row has a gradient in the first step, so both paths take it identically
    moving = dataclasses.replace(flat, advantages=_half_zero_experience().advantages.abs() + flat.loss_mask)
    full, skipping = (
        _step_f64(tmp_path, skip=False, optimizer="adamw"),
        _step_f64(tmp_path, skip=True, optimizer="adamw"),
    )
    for step in (full, skipping):  # a first step with a gradient, so AdamW's moments are not 0
        step(moving, UpdateStats.for_batch(moving))
    before = [p.detach().clone() for p in skipping.policy.parameters()]
    s_full, s_skip = UpdateStats.for_batch(flat), UpdateStats.for_batch(flat)
    full(flat, s_full)
    assert skipping(flat, s_skip) == []  # nothing forwarded
    assert s_skip.rows == [8, 8] and s_skip.steps == 1 and s_skip.grad_norms == [0.0]
    # AdamW stepped on its moments as after a backward of the zero loss: the same weights, bit for bit
    assert max((a - b).abs().max().item() for a, b in zip(skipping.policy.parameters(), before)) > 1e-4
    for a, b in zip(full.policy.parameters(), skipping.policy.parameters()):
        assert torch.equal(a, b)
    m = s_skip.metrics(target_kl=False, ptx=False, critic_lr=None)
    assert m["optim/skipped_rows_frac"] == 1.0 and "policy/entropy" not in m and "entropy/mean" not in m


@pytest.mark.parametrize(
    "sections",
    [
        {"loss": {"entropy_coef": 0.01}},
        {"loss": {"positive_lm_coef": 0.1}},
        {"loss": {"policy_loss": "clip_cov"}},
        {"loss": {"policy_loss": "kl_cov"}},
    ],
)
def test_no_row_is_skipped_when_a_loss_term_does_not_vanish_with_the_advantages(tmp_path, sections):
    step = _step_f64(tmp_path, skip=True, **sections)
    assert step.objective.rows_with_gradient(_half_zero_experience()) is None


def test_a_kl_in_the_loss_keeps_the_rows_unless_beta_is_zero(tmp_path):
    exp = _half_zero_experience()
    step = _step_f64(tmp_path, skip=True, kl={"placement": "loss", "beta": 0.04})
    ref = torch.zeros_like(exp.advantages)
    assert step.objective.rows_with_gradient(dataclasses.replace(exp, ref_logprobs=ref, kl_coef=0.04)) is None
    keep = step.objective.rows_with_gradient(dataclasses.replace(exp, ref_logprobs=ref, kl_coef=0.0))
    assert keep.tolist() == [False] * 4 + [True] * 4


def test_a_registered_loss_is_skipped_only_when_it_declares_it(tmp_path):
    step = _step_f64(tmp_path, skip=True)
    assert step.objective.rows_with_gradient(_half_zero_experience()).tolist() == [False] * 4 + [True] * 4

    def plain(logprobs, old_logprobs, advantages, response_mask):  # no declaration
        return -(advantages * (logprobs - old_logprobs)) * response_mask, {}

    step.objective.policy_loss = plain
    assert step.objective.rows_with_gradient(_half_zero_experience()) is None


def test_target_kl_turns_the_skip_off(tmp_path):
    step = _step_f64(tmp_path, skip=True, target_kl=1.0)
    stats = UpdateStats.for_batch(exp := _half_zero_experience())
    step(exp, stats)
    assert stats.rows == [8, 0]


def test_an_idle_pass_over_minus_infinity_padding_keeps_the_step(tmp_path):
    # A rank with fewer micro-batches (FSDP; after skipped rows, one with none) runs zero-weight
    # passes. Under top-k/top-p the trainer's log-prob of a padding token is -inf, and
    # -inf * 0 = NaN would skip the step on every rank.
    step = _policy_step(tmp_path, 8)

    class OneIdlePass(Single):
        def idle_passes(self, count):  # noqa: ARG002 - the strategy's signature
            return 1

    step.strategy = OneIdlePass(Dist())
    real = step.forward

    def padding_minus_inf(model, rollout, **kwargs):
        logprobs, entropy = real(model, rollout, **kwargs)
        return torch.where(rollout.response_mask[:, : logprobs.shape[1]] > 0, logprobs, -math.inf), entropy

    step.forward = padding_minus_inf
    exp = _experience()
    stats = UpdateStats.for_batch(exp)
    step(exp, stats, idle=exp.select(torch.arange(1)))
    assert (stats.steps, stats.skipped) == (1, 0) and math.isfinite(stats.grad_norms[0])
