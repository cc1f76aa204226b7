"""On the same batch and the same weights, policygrad's GRPO gradient is TRL's.

A policygrad run on the tiny model samples a step; its Experience (prompts, responses, loss
mask, advantages, old and reference log-probs) goes to TRL's ``GRPOTrainer._compute_loss`` on
the same weights, and the two gradients are compared parameter by parameter. This is the check
behind the learning comparisons of ``benchmarks/learn_vs_trl.py``: when the two libraries' curves
differ, it is not because one step's update differs. Each policygrad option is paired with the
TRL ``loss_type`` that computes the same objective:

- ``seq-mean-token-mean`` (the ``grpo`` preset) and TRL's ``grpo``: each sequence's token mean,
  averaged over sequences (Shao et al. 2024, eq. 3);
- ``token-mean`` and ``dapo`` (TRL's default): every token of the batch weighs the same (Yu et al.
  2025, eq. 12);
- ``seq-mean-token-sum-norm`` and ``dr_grpo``: token sums over B x max_new_tokens (Liu et al. 2025);
- a second epoch over the batch with the policy moved (ratios away from 1, some clipped, the
  asymmetric range of ``clip_high``) and a k3 KL in the loss to the reference (TRL's ``beta``).

Across steps, what carries one update into the next (AdamW's moments, the gradient clip, the
learning-rate schedule) is checked by feeding policygrad's pre-clip gradients of several steps to
the optimizer and scheduler TRL's Trainer builds: the weights must be equal, bit for bit.

Tolerance: both sides compute the same function of the same float32 weights in two
implementations (TRL: position ids 0..P+T-1 whatever the left padding, logits of the response
positions only, its own log-softmax; policygrad: position ids counted from the attention mask,
which gives the same attention since RoPE is relative), so their gradients differ by rounding.
The gap is measured against the gradient's norm, the convention of tests/trainer/tolerances.py
(``REL`` = 1e-5 for one micro-batch's float32 sums in another order): measured 2.4e-7 on the first
step and 1.1-1.6e-6 on the clipped second epoch, whose group-centred advantages make the gradient
a sum that partly cancels. A wrong normaliser (a factor of T/mean length, of B, or of
max_new_tokens), a dropped token, a clip bound or a KL weight not applied moves it by 1e-2 or more.
"""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.trainer.factory import build_trainer, prepare_config
from tests.trainer.tolerances import REL
from tests.training import config_with

pytestmark = pytest.mark.integration

pytest.importorskip("trl", reason="TRL is in the test extra: pip install -e '.[test]'")


def varied_reward(prompts, completions, **_):  # noqa: ARG001 - the reward signature
    """A reward with spread inside every group: the completion's length modulo 3."""
    return [float(len(c) % 3) for c in completions]


def captured_step(trainer):
    """Run one step of ``trainer``; returns ``(exp, weights, grads, metrics)``, where
    ``weights[k]`` / ``grads[k]`` are the policy's tensors before optimizer step k of the update and
    its gradients at that step (after clipping, which the configs below disable), and ``exp`` the
    step's Experience (None when the step made none). benchmarks/trl_parity.py's ``batch`` mode
    runs the same capture on the bundled model."""
    weights, grads, captured = [], [], {}
    real_step, real_update = trainer.optimizer.step, trainer.update

    def step(*args, **kwargs):
        params = dict(trainer.policy.named_parameters())
        grads.append({n: p.grad.detach().clone() for n, p in params.items()})
        weights.append({n: p.detach().clone() for n, p in params.items()})
        return real_step(*args, **kwargs)

    def update(exp):
        captured["exp"] = exp
        return real_update(exp)

    trainer.optimizer.step = step
    trainer.update = update
    metrics = trainer.step()
    return captured.get("exp"), weights, grads, metrics


def policygrad_update(tmp_path, tiny_model_dir, **sections):
    """Build a trainer on the tiny model and run one step (:func:`captured_step`); returns
    ``(trainer, exp, weights, grads, metrics)``."""
    cfg = config_with(tmp_path, tiny_model_dir, data={"eval_size": 0, "difficulty": "easy"}, **sections)
    cfg, rewards = prepare_config(cfg, reward_functions=[varied_reward])
    trainer = build_trainer(cfg, reward_objects=rewards)
    exp, weights, grads, metrics = captured_step(trainer)
    return trainer, exp, weights, grads, metrics


def trl_gradient(trainer, exp, weights, *, loss_type, old=False, **config):
    """TRL's ``_compute_loss`` gradient on ``exp`` with the policy's parameters set to ``weights``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    r = trainer.config.rollout
    args = GRPOConfig(
        output_dir=str(trainer.config.output_dir) + "-trl",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=exp.batch_size,
        num_generations=r.group_size,
        max_completion_length=r.max_new_tokens,
        report_to="none",
        loss_type=loss_type,
        gradient_checkpointing=False,
        **config,
    )
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1"}]}] * exp.batch_size)
    grpo = GRPOTrainer(
        model=trainer.policy,
        reward_funcs=[varied_reward],
        args=args,
        train_dataset=rows,
        processing_class=trainer.tokenizer,
    )
    grpo.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one micro-batch here
    model = grpo.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    model.train()
    model.zero_grad(set_to_none=True)
    ro, mask = exp.rollout, exp.loss_mask
    # TRL's completion mask is also its attention mask, and its grpo/dr_grpo count all B rows: the
    # comparison holds where every response token carries loss (every score valid, as here)
    assert torch.equal(mask, ro.response_mask.to(mask))
    assert torch.equal((exp.advantages - exp.advantages[:, :1]) * mask, torch.zeros_like(mask))
    inputs = {
        "prompt_ids": ro.prompt_ids,
        "prompt_mask": ro.prompt_mask,
        "completion_ids": ro.response_ids,
        "completion_mask": mask.long(),
        "advantages": exp.advantages[:, 0],  # GRPO's advantage is one number per sequence
        "num_items_in_batch": mask.sum(),
    }
    if old:
        inputs["old_per_token_logps"] = exp.old_logprobs
    if exp.ref_logprobs is not None:
        inputs["ref_per_token_logps"] = exp.ref_logprobs
    grpo._compute_loss(model, inputs).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_same_gradient(ours, theirs):
    """``||ours - theirs|| <= REL * ||theirs||`` over all parameters (float64 sums)."""
    assert set(ours) == set(theirs)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in theirs.values()))
    gap = math.sqrt(sum(float((ours[n].double() - theirs[n].double()).pow(2).sum()) for n in theirs))
    assert norm > 0.0  # the batch carries a signal: the comparison is not of two zeros
    assert gap <= REL * norm, f"gradients differ by {gap / norm:.2e} of their norm"


NO_CLIP = {"max_grad_norm": 1.0e9}  # compare the raw gradients


@pytest.mark.parametrize(
    ("agg_mode", "loss_type"),
    [("seq-mean-token-mean", "grpo"), ("token-mean", "dapo"), ("seq-mean-token-sum-norm", "dr_grpo")],
)
def test_the_first_update_is_trls_under_each_matching_aggregation(
    tmp_path, tiny_model_dir, agg_mode, loss_type
):
    trainer, exp, weights, grads, _ = policygrad_update(
        tmp_path, tiny_model_dir, algorithm="grpo", loss={"agg_mode": agg_mode}, optim=NO_CLIP
    )
    try:
        assert len(grads) == 1 and exp.old_logprobs is None  # one on-policy step: the ratio is 1
        theirs = trl_gradient(trainer, exp, weights[0], loss_type=loss_type)
        assert_same_gradient(grads[0], theirs)
        # and the bound tells the normalisers apart: another loss_type is another gradient
        other = trl_gradient(trainer, exp, weights[0], loss_type="dapo" if loss_type != "dapo" else "grpo")
        with pytest.raises(AssertionError, match="gradients differ"):
            assert_same_gradient(grads[0], other)
    finally:
        trainer.close()


@pytest.mark.parametrize("importance_weighted", [False, True])
def test_a_second_epoch_with_clipping_and_a_kl_in_the_loss_is_trls(
    tmp_path, tiny_model_dir, importance_weighted
):
    # Two epochs over the batch at a large learning rate: the second step's ratios are far from 1
    # (clipped on both sides of the asymmetric range) and the policy has left the reference.
    # kl.importance_weighted is TRL's use_bias_correction_kl (True by default in trl 1.16.0): the
    # k3 term times pi/pi_old (DeepSeek-AI 2025, DeepSeek-V3.2).
    trainer, exp, weights, grads, metrics = policygrad_update(
        tmp_path,
        tiny_model_dir,
        algorithm="grpo",
        loss={"clip_low": 0.2, "clip_high": 0.28},
        kl={"placement": "loss", "kind": "k3", "beta": 0.1, "importance_weighted": importance_weighted},
        optim={**NO_CLIP, "lr": 0.05, "ppo_epochs": 2},
    )
    try:
        assert len(grads) == 2 and exp.old_logprobs is not None and exp.ref_logprobs is not None
        assert metrics["policy/clipfrac"] > 0.0  # the clip acted in the step compared
        same = {"loss_type": "grpo", "old": True, "beta": 0.1, "epsilon": 0.2, "epsilon_high": 0.28}
        theirs = trl_gradient(trainer, exp, weights[1], **same, use_bias_correction_kl=importance_weighted)
        assert_same_gradient(grads[1], theirs)
        # the weight matters here: without it the KL's gradient is another one
        other = trl_gradient(trainer, exp, weights[1], **same, use_bias_correction_kl=not importance_weighted)
        with pytest.raises(AssertionError, match="gradients differ"):
            assert_same_gradient(grads[1], other)
        # and the upper clip bound acts: TRL with the symmetric range is another gradient
        narrow = {**same, "epsilon_high": 0.2, "use_bias_correction_kl": importance_weighted}
        symmetric = trl_gradient(trainer, exp, weights[1], **narrow)
        with pytest.raises(AssertionError, match="gradients differ"):
            assert_same_gradient(grads[1], symmetric)
    finally:
        trainer.close()


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_several_steps_of_the_optimizer_clip_and_schedule_are_trls(
    tmp_path, tiny_model_dir, monkeypatch, schedule
):
    # The gradient of one batch is checked above; what carries one step into the next is the
    # optimizer's state, the clip and the learning rate. policygrad's pre-clip gradients of five
    # steps (a horizon that is not a power of two, where the linear schedule's rounding showed)
    # go to the optimizer and scheduler TRL's Trainer builds (create_optimizer_and_scheduler:
    # fused AdamW, weight decay 0, no warmup, the schedule over max_steps) and its clip
    # (Trainer._clip_grad_norm, through accelerate: the same total norm, and one more norm of that
    # single number, which is exact). The same computation on the same inputs gives the same bits,
    # so the weights must be equal after every step.
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    steps, lr, max_norm = 5, 1e-3, 0.05  # a clip the tiny model's gradients exceed in every step
    cfg = config_with(
        tmp_path,
        tiny_model_dir,
        steps=steps,
        data={"eval_size": 0, "difficulty": "easy"},
        algorithm="grpo",
        optim={"lr": lr, "max_grad_norm": max_norm, "schedule": schedule},
    )
    cfg, rewards = prepare_config(cfg, reward_functions=[varied_reward])
    trainer = build_trainer(cfg, reward_objects=rewards)
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        ours = dict(trainer.policy.named_parameters())
        theirs = dict(model.named_parameters())
        assert all(torch.equal(ours[n], p) for n, p in theirs.items())
        args = GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
            num_generations=cfg.rollout.group_size,
            report_to="none",
            learning_rate=lr,
            lr_scheduler_type=schedule,
            max_grad_norm=max_norm,
            max_steps=steps,
        )
        rows = Dataset.from_list(
            [{"prompt": [{"role": "user", "content": "1+1"}]}] * args.per_device_train_batch_size
        )
        grpo = GRPOTrainer(
            model=model,
            reward_funcs=[varied_reward],
            args=args,
            train_dataset=rows,
            processing_class=trainer.tokenizer,
        )
        grpo.create_optimizer_and_scheduler(num_training_steps=steps)
        by_id = {id(p): n for n, p in ours.items()}
        captured = []
        real_clip = torch.nn.utils.clip_grad_norm_

        def clip(params, *args, **kwargs):
            params = list(params)
            captured.append({by_id[id(p)]: p.grad.detach().clone() for p in params if id(p) in by_id})
            return real_clip(params, *args, **kwargs)

        for _ in range(steps):
            captured.clear()
            with monkeypatch.context() as m:
                m.setattr(torch.nn.utils, "clip_grad_norm_", clip)
                metrics = trainer.step()
            assert len(captured) == 1 and set(captured[0]) == set(theirs)  # one optimizer step, every weight
            for n, p in theirs.items():
                p.grad = captured[0][n]
            norm = float(grpo._clip_grad_norm(model))
            assert norm == metrics["optim/grad_norm"] and norm > max_norm  # a signal, clipped
            grpo.optimizer.step()
            grpo.lr_scheduler.step()
            grpo.optimizer.zero_grad(set_to_none=True)
            # policygrad's optim/lr is the next step's rate (TRL's Trainer logs the one the step used)
            assert metrics["optim/lr"] == grpo.lr_scheduler.get_last_lr()[0]
            moved = [n for n, p in theirs.items() if not torch.equal(ours[n], p)]
            assert not moved, f"after step {trainer.step_idx}: {moved[:3]} differ"
        start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        assert any(
            not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters())
        )  # it trained
    finally:
        trainer.close()
