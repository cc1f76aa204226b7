"""The one optimizer step of the policy and the critic: accumulation, clipping, non-finite
losses and norms skip the step untouched, ``cancel`` takes none; AdamW and the schedule."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from policygrad.learn.optim import OptimizerStep, lr_schedule, make_adamw, set_base_lr
from policygrad.parallel.distributed import Dist
from policygrad.parallel.strategy import Single

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


class Collective(Single):
    """One process whose backward passes are collectives (as under FSDP)."""

    collective = True


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _step(net, *, strategy=None, max_grad_norm=1.0, lr=1e-2):
    params = list(net.parameters())
    opt = make_adamw(params, lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
    return OptimizerStep(
        opt, sched, params, max_grad_norm=max_grad_norm, device=CPU, strategy=strategy or Single(Dist())
    )


X = torch.linspace(-1, 1, 24).reshape(6, 4)


def _loss(net, scale=1.0):
    return net(X).pow(2).mean() * scale


def _snapshot(step):
    return (
        copy.deepcopy([p.detach() for p in step.params]),
        copy.deepcopy(step.optimizer.state_dict()),
        step.scheduler.last_epoch,
        step.scheduler.get_last_lr(),
    )


def _same(a, b):
    (wa, oa, ea, la), (wb, ob, eb, lb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))
    assert ea == eb and la == lb
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for k in oa["state"]:
        for name, value in oa["state"][k].items():
            assert torch.equal(value, ob["state"][k][name]), name


def test_two_half_losses_step_exactly_like_one_full_loss():
    one, two = _net(), _net()
    s1, s2 = _step(one), _step(two)
    for _ in range(2):  # the second step also uses the AdamW moments of the first
        s1.zero()
        assert s1.backward(_loss(one))
        out1 = s1.apply()
        s2.zero()
        # 0.5 * g + 0.5 * g == g exactly in floating point (scaling by 0.5 and doubling are exact).
        assert s2.backward(_loss(two, 0.5)) and s2.backward(_loss(two, 0.5))
        out2 = s2.apply()
        assert out1.applied and out2.applied
        assert out1.grad_norm == out2.grad_norm
        assert out2.loss == pytest.approx(out1.loss, rel=1e-7)
    for a, b in zip(one.parameters(), two.parameters()):
        assert torch.equal(a, b)
    assert s1.scheduler.last_epoch == s2.scheduler.last_epoch == 2


def test_clipping_by_hand_with_sgd():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _k: 1.0)
    step = OptimizerStep(opt, sched, [w], max_grad_norm=1.0, device=CPU, strategy=Single(Dist()))
    step.zero()
    step.backward((w * torch.tensor([3.0, 4.0])).sum())
    out = step.apply()
    # grad (3, 4) has norm 5; clipped by 1 / (5 + 1e-6) (torch's epsilon) to about (0.6, 0.8);
    # SGD with lr 1: w = -(0.6, 0.8) up to 0.8 * 1e-6 / 5 = 1.6e-7.
    assert out.grad_norm == 5.0 and out.applied and not out.stopped and out.loss == 0.0
    assert torch.allclose(w.detach(), torch.tensor([-0.6, -0.8]), rtol=0, atol=3e-7)
    assert w.grad is None  # zeroed (set to None) on return


def test_a_non_finite_loss_skips_the_step_and_touches_nothing():
    net = _net()
    step = _step(net)
    step.zero()
    step.backward(_loss(net))
    step.apply()  # AdamW state and schedule exist before the skipped step
    before = _snapshot(step)
    step.zero()
    assert step.backward(_loss(net)) is True
    assert step.backward(_loss(net) * float("nan")) is False  # stop computing losses
    assert not step.proceeding
    out = step.apply()
    assert not out.applied and not out.stopped and out.grad_norm is None
    assert out.loss == pytest.approx(_loss(net).item(), rel=1e-6)  # the finite one only
    _same(before, _snapshot(step))
    assert all(p.grad is None for p in net.parameters())


def test_a_non_finite_gradient_norm_skips_the_step():
    w = torch.nn.Parameter(torch.zeros(3))
    opt = make_adamw([w], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _k: 1.0)
    step = OptimizerStep(opt, sched, [w], max_grad_norm=1.0, device=CPU, strategy=Single(Dist()))
    step.zero()
    assert step.backward(w.sqrt().sum())  # loss 0 is finite; d sqrt(w)/dw at 0 is inf
    out = step.apply()
    assert out.grad_norm == math.inf and not out.applied
    assert (
        torch.equal(w.detach(), torch.zeros(3)) and sched.last_epoch == 0 and opt.state_dict()["state"] == {}
    )


def test_cancel_leaves_the_weights_and_zeroes_the_gradients():
    net = _net()
    step = _step(net)
    before = _snapshot(step)
    step.zero()
    step.backward(_loss(net))
    assert all(p.grad is not None for p in net.parameters())
    out = step.cancel()
    assert out.stopped and not out.applied and out.grad_norm is None
    assert all(p.grad is None for p in net.parameters())
    _same(before, _snapshot(step))


def test_a_collective_strategy_backpropagates_every_loss_after_a_non_finite_one():
    net = _net()
    step = _step(net, strategy=Collective(Dist()))
    before = _snapshot(step)
    step.zero()
    first = net[0].weight.sum() * float("inf")  # non-finite, and it reaches only the first layer
    assert step.backward(first) is True and step.proceeding  # a collective backward is still wanted
    later = net[2].bias.sum() * 2.0
    assert step.backward(later) is True
    assert torch.equal(net[2].bias.grad, torch.tensor([2.0]))  # the later loss was backpropagated
    assert step.outcome.loss == 0.0  # losses after a non-finite one are not counted
    out = step.apply()
    assert not out.applied and out.grad_norm is None
    _same(before, _snapshot(step))


def test_zero_starts_a_fresh_outcome_and_count_false_is_not_in_the_loss():
    net = _net()
    step = _step(net)
    step.zero()
    step.backward(_loss(net) * float("nan"))
    step.zero()
    assert step.finite and step.proceeding and step.outcome.loss == 0.0
    step.backward(torch.tensor(2.0, requires_grad=True))
    step.backward(torch.tensor(5.0, requires_grad=True), count=False)  # e.g. the PPO-ptx LM loss
    assert step.outcome.loss == 2.0


def test_make_adamw_is_fused_on_the_cpu_and_refuses_no_parameters():
    opt = make_adamw(_net().parameters(), lr=1e-3, betas=[0.9, 0.95], eps=1e-6, weight_decay=0.0)
    assert opt.defaults["fused"] is True and opt.defaults["betas"] == (0.9, 0.95)
    with pytest.raises(ValueError, match="no trainable parameters"):
        make_adamw([], lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)


def _cfg(schedule, warmup=0):
    return SimpleNamespace(schedule=schedule, warmup_steps=warmup)


def test_lr_schedule_warmup_then_linear_decay():
    f = lr_schedule(_cfg("linear", warmup=2), total=10)
    # warmup: (k + 1) / 2; then 1 - (k - 2) / 8, clamped to [0, 1].
    assert [f(k) for k in (0, 1, 2, 6, 10, 12)] == [0.5, 1.0, 1.0, 0.5, 0.0, 0.0]


def test_lr_schedule_cosine_and_constant():
    f = lr_schedule(_cfg("cosine"), total=8)
    # 0.5 * (1 + cos(pi * k / 8)): k=2 -> 0.5 * (1 + sqrt(2)/2) = 0.853553..., k=4 -> 0.5, k=8 -> 0.
    assert f(0) == 1.0 and f(4) == pytest.approx(0.5, abs=1e-15) and f(8) == 0.0
    assert f(2) == pytest.approx(0.8535533905932737, abs=1e-15)
    g = lr_schedule(_cfg("constant", warmup=4), total=8)
    assert [g(k) for k in (0, 3, 4, 100)] == [0.25, 1.0, 1.0, 1.0]
    assert lr_schedule(_cfg("linear"), total=1)(0) == 1.0 and lr_schedule(_cfg("linear"), total=1)(1) == 0.0


@pytest.mark.parametrize("total", [3, 5, 12, 300])
@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_lr_schedule_after_warmup_is_transformers_to_the_bit(schedule, total):
    # Past the warmup the factors are transformers' own (their schedules' lambdas, which TRL's
    # Trainer uses), compared with ==: a horizon that is not a power of two once showed 1 - x
    # against (total - k) / span differing in the last bit.
    from transformers.optimization import (
        _get_constant_schedule_with_warmup_lr_lambda,
        _get_cosine_schedule_with_warmup_lr_lambda,
        _get_linear_schedule_with_warmup_lr_lambda,
    )

    warmup = 2
    theirs = {
        "linear": lambda k: _get_linear_schedule_with_warmup_lr_lambda(
            k, num_warmup_steps=warmup, num_training_steps=total
        ),
        "cosine": lambda k: _get_cosine_schedule_with_warmup_lr_lambda(
            k, num_warmup_steps=warmup, num_training_steps=total, num_cycles=0.5
        ),
        "constant": lambda k: _get_constant_schedule_with_warmup_lr_lambda(k, num_warmup_steps=warmup),
    }[schedule]
    ours = lr_schedule(_cfg(schedule, warmup=warmup), total=total)
    assert [ours(k) for k in range(warmup, total + 1)] == [theirs(k) for k in range(warmup, total + 1)]
    # the warmup itself differs by design: transformers' first step runs at rate 0, ours at 1/W
    assert theirs(0) == 0.0 and ours(0) == 1 / warmup


# ----------------------------------------------------------------------------- fp16 loss scaling


def _scaled_step(p, scaler):
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return OptimizerStep(
        opt, sched, [p], max_grad_norm=100.0, device=CPU, strategy=Single(Dist()), scaler=scaler
    )


def test_loss_scaling_unscales_before_the_step_and_skips_an_overflow_halving_the_scale(caplog):
    # Scale 2**4, growth every 2 clean steps. loss = 3 p: the backward sees 16 * 3 = 48, the step
    # sees 48 / 16 = 3 (powers of two: exact), so SGD lr 0.1 moves p = 1 to 1 - 0.3 = 0.7.
    p = torch.nn.Parameter(torch.tensor([1.0]))
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2)
    step = _scaled_step(p, scaler)
    step.zero()
    assert step.backward(3 * p.sum())
    out = step.apply()
    assert out.applied and out.grad_norm == 3.0 and out.loss == 3.0
    assert p.item() == pytest.approx(0.7) and step.loss_scale == 16.0
    # loss = 1e38 p (finite: 7e37): the scaled gradient 16e38 overflows float32 (max 3.4e38) to
    # inf -> the step is skipped,
    # p stays 0.7, the scale halves to 8 and the growth count restarts.
    step.zero()
    step.backward(1e38 * p.sum())
    with caplog.at_level("WARNING"):
        out = step.apply()
    assert not out.applied and p.item() == pytest.approx(0.7) and p.grad is None
    assert step.loss_scale == 8.0 and scaler.state_dict()["_growth_tracker"] == 0
    assert "loss scale 16 -> 8" in caplog.text
    # Two clean steps at scale 8: the second doubles it back to 16 (growth_interval 2).
    for expected in (8.0, 16.0):
        step.zero()
        step.backward(p.sum())
        assert step.apply().applied and step.loss_scale == expected
    assert p.item() == pytest.approx(0.5)


def test_a_nonfinite_loss_before_any_scaled_loss_still_backs_the_scale_off():
    # The first loss is NaN: nothing was scaled or backpropagated; the scale still halves (65536 -> 32768).
    p = torch.nn.Parameter(torch.tensor([1.0]))
    step = _scaled_step(p, torch.amp.GradScaler("cpu"))
    step.zero()
    assert not step.backward(p.sum() * float("nan"))
    assert not step.apply().applied and step.loss_scale == 32768.0 and p.item() == 1.0


def test_without_a_scaler_the_step_reports_no_loss_scale():
    assert _step(_net()).loss_scale is None


def test_set_base_lr_keeps_the_schedules_position():
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.025, 0.025], abs=1e-15)  # 0.1 x 0.25
    set_base_lr(optimizer, scheduler, 0.2)
    # Step 2 of the schedule: factor 0.5^2 = 0.25, so the rate is 0.2 x 0.25 = 0.05 at once ...
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.05], abs=1e-15)
    assert scheduler.base_lrs == [0.2, 0.2]
    assert [g["initial_lr"] for g in optimizer.param_groups] == [0.2, 0.2]
    # ... and the schedule goes on from there: step 3, 0.2 x 0.125 = 0.025.
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.025, 0.025], abs=1e-15)


def test_a_new_lr_keeps_the_schedule_position():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (k + 1))
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    set_base_lr(optimizer, scheduler, 0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 / 4)
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [pytest.approx(0.5 / 5)]
