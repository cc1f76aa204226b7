"""Tests of the training loop on a tiny random Llama: every algorithm end to end, what carries
loss, the on-policy ratio, resume, gradient accumulation, skipped non-finite updates, reward
failures, dynamic sampling and the run directory.

Rewards come from ``tests/trainer/conftest.py``'s reward file (the answer-correctness reward of a
random model is always 0, which would make every advantage 0)."""

from __future__ import annotations

import copy
import dataclasses
import glob
import inspect
import json
import math
import os
import sys
from unittest import mock

import pytest
import torch

from policygrad.config.train import ConfigError
from policygrad.core.masking import aggregate
from policygrad.learn.optim import OptimizerStep
from policygrad.learn.update import UpdateStats
from policygrad.models.forward import policy_logprobs
from policygrad.models.loading import eos_token_ids, load_causal_lm, load_tokenizer
from policygrad.rewards.registry import RewardFunctionError
from policygrad.rollout import HFRolloutEngine
from policygrad.run import Run
from policygrad.trainer import TrainingError
from policygrad.trainer.loop import Trainer
from tests.training import checkpoint_weights, write_jsonl

pytestmark = pytest.mark.integration

VOLATILE = ("time/", "perf/", "memory/")


def comparable(metrics: dict) -> dict:
    """Metrics without wall-clock and memory readings; NaN replaced by a marker so == works."""
    return {
        k: ("nan" if isinstance(v, float) and math.isnan(v) else v)
        for k, v in metrics.items()
        if not k.startswith(VOLATILE)
    }


def model_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _optimizer_state(optimizer) -> dict:
    return copy.deepcopy(optimizer.state_dict())


def same_tree(a, b) -> bool:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


class Spy:
    """Records every training forward of a trainer: the per-token log-probs and entropies it
    returned (their gradients are kept) with the response mask of the rows it ran on (as the
    rollout engine produced it), and the arguments and metrics of the policy-loss call that
    follows, with the number of optimizer steps taken before it."""

    def __init__(self, run: Run):
        self.calls: list[dict] = []
        self.outputs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.response_masks: list[torch.Tensor] = []
        self.optimizer_steps = 0
        run.trainer.optimizer.register_step_post_hook(self._count)
        policy_loss = run.trainer.objective.policy_loss

        def spy_loss(logprobs, old_logprobs, advantages, mask, **options):
            out = policy_loss(logprobs, old_logprobs, advantages, mask, **options)
            self.calls.append(
                {
                    "logprobs": logprobs.detach().clone(),
                    "old": old_logprobs.detach().clone(),
                    "advantages": advantages.detach().clone(),
                    "mask": mask.detach().clone(),
                    "metrics": {k: float(v) for k, v in out[1].items()},
                    "after_steps": self.optimizer_steps,
                }
            )
            return out

        run.trainer.objective.policy_loss = spy_loss
        policy_logprobs = run.trainer.policy_step.forward

        def spy_logprobs(model, rollout, **kwargs):
            logprobs, entropy = policy_logprobs(model, rollout, **kwargs)
            if logprobs.requires_grad:  # training forwards only (inference runs without autograd)
                logprobs.retain_grad()
                if entropy is not None and entropy.requires_grad:
                    entropy.retain_grad()
                self.outputs.append((logprobs, entropy))
                self.response_masks.append(rollout.response_mask.clone())
            return logprobs, entropy

        run.trainer.policy_step.forward = spy_logprobs

    @property
    def grads(self) -> list[torch.Tensor]:
        """Per training forward: |d loss / d logprob| + |d loss / d entropy| per token [B, T]
        (the entropy term only with an entropy bonus)."""
        out = []
        for logprobs, entropy in self.outputs:
            g = logprobs.grad.abs()
            if entropy is not None and entropy.grad is not None:
                g = g + entropy.grad.abs()
            out.append(g)
        return out

    def _count(self, *_args):
        self.optimizer_steps += 1


def poison_masked_positions(trainer: Run) -> None:
    """Fill everything the loss must not see with garbage: prompt padding and post-EOS token ids
    become random tokens, and the sampler's, old and reference log-probs become NaN wherever
    ``response_mask`` is 0. A loop that masks correctly gives bitwise the same step."""

    def poisoned(logprobs_pass):
        def run(rollout):
            return logprobs_pass(rollout).masked_fill(rollout.response_mask == 0, float("nan"))

        return run

    generate = trainer.trainer.engine.generate

    def poisoned_generate(*args, **kwargs):
        r = generate(*args, **kwargs)
        g = torch.Generator().manual_seed(123)
        junk_response = torch.randint(4, 100, r.response_ids.shape, generator=g)
        junk_prompt = torch.randint(4, 100, r.prompt_ids.shape, generator=g)
        return dataclasses.replace(
            r,
            response_ids=torch.where(r.response_mask > 0, r.response_ids, junk_response),
            prompt_ids=torch.where(r.prompt_mask > 0, r.prompt_ids, junk_prompt),
            sampler_logprobs=r.sampler_logprobs.masked_fill(r.response_mask == 0, float("nan")),
        )

    trainer.trainer.old_logprobs = poisoned(trainer.trainer.old_logprobs)
    trainer.trainer.reference_logprobs = poisoned(trainer.trainer.reference_logprobs)
    trainer.trainer.engine.generate = poisoned_generate


# ----------------------------------------------------------------------------- every algorithm

# One variant per algorithm so that together they cover both KL placements, k1/k2/k3, the
# importance-weighted KL term, the adaptive controller, recomputed old log-probs (minibatches or
# epochs) and the truncation policies. Every variant has an entropy bonus.
VARIANTS = {
    "reinforce": {"kl": {"placement": "reward", "beta": 0.1}, "optim": {"num_minibatches": 2}},
    "rloo": {"kl": {"placement": "loss", "beta": 0.1}, "optim": {"ppo_epochs": 2}},
    "remax": {"kl": {"placement": "reward", "beta": 0.1, "kind": "k2"}},
    "grpo": {
        "kl": {"placement": "loss", "beta": 0.1, "importance_weighted": True},
        "optim": {"num_minibatches": 2},
        "reward": {"truncation": "exclude"},
    },
    "dr_grpo": {
        "kl": {"placement": "loss", "beta": 0.1, "kind": "k2"},
        "optim": {"ppo_epochs": 2},
        "reward": {"truncation": "penalty", "truncation_penalty": -0.5},
    },
    "reinforce_pp": {
        "kl": {"placement": "reward", "beta": 0.1, "controller": "adaptive", "target": 0.5, "horizon": 100},
        "optim": {"num_minibatches": 2},
    },
}


@pytest.mark.parametrize("algorithm", sorted(VARIANTS))
def test_every_algorithm_trains_and_masked_tokens_carry_nothing(algorithm, make_config):
    sections = {"algorithm": algorithm, "loss": {"entropy_coef": 0.01}, **VARIANTS[algorithm]}
    run = Run(make_config("clean", reward_fn="length_fraction", **sections))
    before = model_weights(run.trainer.policy)
    spy = Spy(run)
    metrics = [run.trainer.step() for _ in range(2)]

    # Parameters changed (every tensor of the model), losses finite, nothing skipped.
    after = model_weights(run.trainer.policy)
    assert all(not torch.equal(before[k], after[k]) for k in before)
    for m in metrics:
        assert math.isfinite(m["policy/loss"]) and math.isfinite(m["policy/entropy"])
        assert m["optim/steps"] >= 1 and m["optim/skipped_nonfinite"] == 0
        assert math.isfinite(m["kl/ref"]) and m["kl/coef"] > 0
        if sections["kl"]["placement"] == "loss":
            assert math.isfinite(m["kl/loss_term"])
    assert any(bool((c["advantages"][c["mask"] > 0] != 0).any()) for c in spy.calls)

    # Gradients w.r.t. each token's log-prob and entropy: exactly 0 wherever the engine's response
    # mask is 0 (padding, after EOS) and on rows excluded from the loss, with the policy loss, the
    # KL term (placement loss) and the entropy bonus all in the loss; nonzero at the other tokens.
    # (The training forward computes nothing at all at masked positions: see test_shared_prompt.)
    assert len(spy.outputs) == len(spy.calls) == len(spy.response_masks)
    masked_after_eos = 0
    for grad, response_mask, call in zip(spy.grads, spy.response_masks, spy.calls):
        loss_mask = call["mask"]
        assert grad.shape == response_mask.shape
        # the loss mask is the response mask on the rows that take part in the loss
        assert torch.equal(loss_mask, response_mask * loss_mask.any(-1, keepdim=True))
        assert torch.count_nonzero(grad[response_mask == 0]) == 0
        assert torch.count_nonzero(grad[loss_mask == 0]) == 0
        assert torch.count_nonzero(grad[loss_mask > 0]) > 0
        masked_after_eos += int(((response_mask == 0) & response_mask.any(-1, keepdim=True)).sum())
    assert masked_after_eos > 0  # the check above saw real post-EOS padding

    # Garbage at every masked position (prompt padding and post-EOS token ids, NaN sampler / old /
    # reference log-probs) changes nothing: same metrics, bitwise the same weights.
    poisoned = Run(make_config("poisoned", reward_fn="length_fraction", **sections))
    poison_masked_positions(poisoned)
    poisoned_metrics = [poisoned.trainer.step() for _ in range(2)]
    assert [comparable(m) for m in poisoned_metrics] == [comparable(m) for m in metrics]
    assert same_tree(model_weights(poisoned.trainer.policy), after)


def test_kl_placement_none_loads_no_reference(make_config):
    run = Run(make_config(kl={"placement": "none"}))
    assert run.trainer.reference is None
    m = run.trainer.step()
    assert "kl/ref" not in m and "kl/loss_term" not in m and m["kl/coef"] == 0.0


@pytest.mark.parametrize("placement", ["reward", "loss"])
@pytest.mark.parametrize("rollout", [{"top_k": 5}, {"top_p": 0.9}])
def test_top_k_or_top_p_with_a_kl_is_refused(placement, rollout, make_config):
    # The truncated sampler's log-probs are renormalised over the kept set, the reference's are
    # of the full softmax: their difference is -log(kept mass) > 0 on every token even for an
    # unchanged policy (measured 0.6-2.7 nats/token on the tiny model at step 1), a hidden length
    # penalty. Until the KL uses untruncated policy log-probs, the combination is refused.
    with pytest.raises(ConfigError, match="rollout.top_k/top_p truncation is not supported"):
        make_config(rollout=rollout, kl={"placement": placement, "beta": 0.1})


def test_training_logprobs_are_those_of_the_response_tokens(eos_model_dir):
    # policy_logprobs must give, at every valid position, the log-prob of that response token
    # given its prompt and the response before it, whatever the left padding of the batch: the
    # same value as a forward of that row alone with no padding, and the sampler's value.
    tokenizer = load_tokenizer(eos_model_dir)
    model = load_causal_lm(eos_model_dir, trainable=True)
    engine = HFRolloutEngine(model, tokenizer, eos_token_ids(tokenizer, model))
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["7+8=", "What is 12*3?", "x"]]
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9)]:
        rollout = engine.generate(
            prompts,
            group_size=2,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=6,
            generator_seed=3,
        )
        with torch.no_grad():
            lp, _ = policy_logprobs(model, rollout, temperature=temperature, top_k=top_k, top_p=top_p)
        valid = rollout.response_mask > 0
        assert lp.shape == rollout.response_ids.shape
        rows = []
        for i in range(rollout.batch_size):
            prompt = rollout.prompt_ids[i][rollout.prompt_mask[i] > 0]
            n = int(rollout.response_mask[i].sum())
            response = rollout.response_ids[i, :n]
            with torch.no_grad():
                logits = model(torch.cat([prompt, response])[None]).logits[0]
            rows.append((n, response, logits[prompt.numel() - 1 : prompt.numel() - 1 + n] / temperature))
        # The three forwards (padded batch, the sampler's cached decode, one row alone) sum in
        # other orders. log_softmax(z)_y = z_y - logsumexp(z) moves by at most 2 max_v |dz_v|, and
        # a logit, a plain matmul sum, carries REL = 1e-5 of the logits' scale max |z| (here up to
        # ~9 / temperature: a 1.4e-5 gap was measured with ATEN_CPU_CAPABILITY=default, over the
        # 1e-5 this test used to allow).
        atol = 2 * 1e-5 * max(float(z.abs().max()) for _, _, z in rows)
        torch.testing.assert_close(lp[valid], rollout.sampler_logprobs[valid], atol=atol, rtol=0)
        if top_k or top_p < 1.0:
            continue
        for i, (n, response, z) in enumerate(rows):
            expected = torch.log_softmax(z, -1).gather(-1, response[:, None]).squeeze(-1)
            torch.testing.assert_close(lp[i, :n], expected, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- ratio at the start


@pytest.mark.parametrize(
    "ppo_epochs, num_minibatches, micro_batch_size",
    [(1, 1, 8), (1, 1, 3), (1, 2, 3), (2, 1, 8), (2, 4, 3), (3, 2, 8)],
)
def test_first_minibatch_ratio_is_one(ppo_epochs, num_minibatches, micro_batch_size, make_config):
    run = Run(
        make_config(
            reward_fn="length_fraction",
            optim={
                "ppo_epochs": ppo_epochs,
                "num_minibatches": num_minibatches,
                "micro_batch_size": micro_batch_size,
                "lr": 5e-2,
            },
        )
    )
    recomputed = []
    old_logprobs = run.trainer.old_logprobs
    run.trainer.old_logprobs = lambda rollout: recomputed.append(1) or old_logprobs(rollout)
    spy = Spy(run)
    run.trainer.step()
    on_policy = ppo_epochs == 1 and num_minibatches == 1
    # the extra forward for old log-probs runs only when the update is not exactly on-policy
    assert len(recomputed) == (0 if on_policy else 1)
    first = [c for c in spy.calls if c["after_steps"] == 0]
    assert first and len(first) == math.ceil(8 / num_minibatches / micro_batch_size)
    for c in first:
        valid = c["mask"] > 0
        # The old log-probs are the training forward's own numbers up to float rounding: the two
        # passes group rows into micro-batches differently, and the shared-prompt forward runs each
        # micro-batch's distinct prompts as one batch, so the last bits may differ. Measured on the
        # per-prompt sampling stream: <= 1.2e-5 over these parametrisations (0 where nothing is
        # regrouped; ~1e-6 of the tiny model's logits, which reach ~12). An old pass under other
        # weights or temperature is off by far more (measured: temperature 0.9 instead of 1 by 0.13,
        # the weights after one step by >= 6.8), so 2e-5 still fails on a real bug.
        torch.testing.assert_close(c["logprobs"][valid], c["old"][valid], atol=2e-5, rtol=0)
        if on_policy:  # the ratio is then exactly 1 by construction (old = logprobs.detach())
            assert c["metrics"]["approx_kl"] == 0.0 and c["metrics"]["ratio_mean"] == 1.0
        assert abs(c["metrics"]["ratio_mean"] - 1.0) < 1e-5 and c["metrics"]["clipfrac"] == 0.0
    if not on_policy:
        # after an update the ratio moves: old log-probs are the pre-update ones, not recomputed
        later = [c for c in spy.calls if c["after_steps"] > 0]
        assert later and any(c["metrics"]["approx_kl"] > 0 for c in later)


# ----------------------------------------------------------------------------- resume


def _resume_sections(tmp_path, lora: bool) -> dict:
    data = write_jsonl(
        tmp_path / "train.jsonl",
        [{"prompt": f"What is {a}+{a}?", "answer": str(2 * a)} for a in (3, 5, 8)],
    )
    sections = {
        "steps": 4,
        "eval_before": True,
        "eval_after": True,
        "eval_every": 2,
        "data": {"dataset": data, "eval_dataset": data, "eval_size": 2, "shuffle": True},
        "kl": {"placement": "reward", "beta": 0.05, "controller": "adaptive", "target": 0.1, "horizon": 50},
        "optim": {"schedule": "cosine", "warmup_steps": 1, "ppo_epochs": 2, "num_minibatches": 2, "lr": 1e-2},
        "loss": {"entropy_coef": 0.01},
    }
    if lora:
        sections["model"] = {"lora": {"rank": 4, "alpha": 8.0}}
        sections["kl"] = {"placement": "loss", "beta": 0.05}
    else:  # an adaptive entropy coefficient whose target is never reached: 0.01 + 0.005 per step
        sections["loss"].update(entropy_target=4.6, entropy_coef_delta=0.005)  # below ln 100 = 4.605
    return sections


def _metrics_rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [comparable(json.loads(line)) for line in f]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_equals_a_straight_run_bitwise(lora, make_config, tmp_path, monkeypatch):
    # Over a data epoch boundary (3 rows, 2 per step), a cosine schedule with warmup, an adaptive
    # KL controller, old log-probs from 2 epochs x 2 minibatches, and evaluations on the way.
    sections = _resume_sections(tmp_path, lora)
    straight = Run(make_config("straight", **sections))
    straight.train()

    # Interrupted: a checkpoint at step 2, step 3 runs and is logged, then the run dies.
    cfg = make_config("resumed", save_every=2, **sections)
    step = Trainer.step

    def dies_at_step_4(self):
        if self.step_idx == 3:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Trainer, "step", dies_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg).train()
    monkeypatch.setattr(Trainer, "step", step)
    assert [r["step"] for r in _metrics_rows(cfg.output_dir)] == [0, 1, 2, 3]
    resumed = Run(cfg, resume_from=cfg.output_dir)
    assert resumed.trainer.step_idx == 2 and resumed.trainer.stream.position == 4
    resumed.train()

    # The row of step 3 written before the interruption is dropped; each step appears once.
    rows = _metrics_rows(cfg.output_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 4]  # eval before, 4 steps, eval after
    assert rows == _metrics_rows(straight.run_dir)
    a, b = checkpoint_weights(straight.run_dir, 4), checkpoint_weights(cfg.output_dir, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert same_tree(model_weights(resumed.trainer.policy), model_weights(straight.trainer.policy))
    a, b = resumed.trainer, straight.trainer
    assert same_tree(_optimizer_state(a.optimizer), _optimizer_state(b.optimizer))
    assert resumed.trainer.kl_ctl.state_dict() == straight.trainer.kl_ctl.state_dict()
    assert resumed.trainer.scheduler.state_dict() == straight.trainer.scheduler.state_dict()
    coefs = [r["entropy/coef"] for r in rows if "entropy/coef" in r]
    if lora:
        assert resumed.trainer.entropy_ctl is None and coefs == [0.01] * 4
    else:
        assert coefs == pytest.approx([0.01, 0.015, 0.02, 0.025], abs=1e-12)
        assert resumed.trainer.entropy_ctl.state_dict() == straight.trainer.entropy_ctl.state_dict()


def test_resume_without_a_checkpoint_says_so(make_config, tmp_path):
    with pytest.raises(TrainingError, match="no checkpoint found under"):
        Run(make_config(), resume_from=str(tmp_path / "empty"))


# ----------------------------------------------------------------------------- gradient accumulation


def _one_step_gradients(
    make_config,
    name,
    algorithm,
    micro_batch_size,
    *,
    local_counts=False,
    loss=None,
    epochs=1,
    hook=None,
    reward_fn="digit_fraction",
    lr=1.0,
):
    # eps = 1 and lr = 1 make AdamW's first step w - g / (|g| + 1) ~ w - g (sensitive to the
    # gradient's scale, unlike the sign-like step of a small eps); no clipping.
    run = Run(
        make_config(
            name,
            algorithm=algorithm,
            optim={
                "micro_batch_size": micro_batch_size,
                "lr": lr,
                "eps": 1.0,
                "max_grad_norm": 1e9,
                "ppo_epochs": epochs,
            },
            loss={"entropy_coef": 0.01, **(loss or {})},
            kl={"placement": "loss", "beta": 0.1},
            reward_fn=reward_fn,
        )
    )
    if hook is not None:
        hook(run)
    names = {id(p): n for n, p in run.trainer.policy.named_parameters()}
    grads, added, scale, total = {}, {}, {}, {}

    def record(_optimizer, _args, _kwargs):
        for name_, p in run.trainer.policy.named_parameters():
            grads[name_] = p.grad.detach().clone()
            scale[name_] = added.pop(name_, 0.0)
            total[name_] = total.get(name_, 0.0) + scale[name_]

    backward = OptimizerStep.backward

    def measuring(self, loss_, **kwargs):
        # the largest entry each backward (a micro-batch) adds to each tensor's gradient
        before = {id(p): None if p.grad is None else p.grad.detach().clone() for p in self.params}
        out = backward(self, loss_, **kwargs)
        for p in self.params:
            if p.grad is not None and id(p) in names:
                step_ = p.grad - (0 if before[id(p)] is None else before[id(p)])
                added[names[id(p)]] = added.get(names[id(p)], 0.0) + float(step_.abs().max())
        return out

    run.trainer.optimizer.register_step_pre_hook(record)
    if local_counts:
        # Normalise each micro-batch by its own counts (what omitting the global counts does).
        objective = run.trainer.objective
        objective.reduce = lambda loss_matrix, mask, _counts, _sample_tokens=None: aggregate(
            loss_matrix, mask, objective.agg_mode, max_len=objective.max_len
        )
    with mock.patch.object(OptimizerStep, "backward", measuring):
        run.trainer.step()
    steps = run.trainer.optimizer.state_dict()["state"]
    steps = max((int(v["step"]) for v in steps.values()), default=0)  # AdamW's step count
    return grads, model_weights(run.trainer.policy), {"last": scale, "total": total, "steps": steps}


def _relative_error(grads: dict, reference: dict) -> float:
    """Largest |g - g_ref| of any tensor, relative to that tensor's largest |g_ref|."""
    return max(float((grads[k] - reference[k]).abs().max() / reference[k].abs().max()) for k in reference)


def _assert_same_step(run: tuple, reference: tuple, lr: float) -> None:
    """Two runs' gradients (of the last optimizer step) and weights agree to float32 summation
    order. Each backward (micro-batch) adds a gradient whose entries carry REL = 1e-5 of its
    largest entry (a plain float32 sum), so an entry of the accumulated gradient may differ by
    REL * (sum over micro-batches of their largest entry, in both runs). AdamW with eps = 1 moves
    a weight by lr * m / (sqrt(v) + 1), whose derivative in each step's gradient is at most lr (to
    first order; m's weights over steps sum to 1): the weights by lr * REL times those sums over
    every step, plus each step's rounding of the new weight (eps32 |w| in each run)."""
    (grads, weights, scales), (ref_grads, ref_weights, ref_scales) = run, reference
    for k in ref_grads:
        allowed = 1e-5 * (scales["last"][k] + ref_scales["last"][k])
        assert float((grads[k] - ref_grads[k]).abs().max()) <= allowed, k
        rounding = 2 * scales["steps"] * torch.finfo(torch.float32).eps * float(ref_weights[k].abs().max())
        allowed = lr * 1e-5 * (scales["total"][k] + ref_scales["total"][k]) + rounding
        assert float((weights[k] - ref_weights[k]).abs().max()) <= allowed, k


@pytest.mark.parametrize(
    "algorithm",
    ["reinforce", "grpo", "dr_grpo"],
    ids=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
)
def test_gradient_accumulation_equals_the_full_batch(algorithm, make_config):
    full = _one_step_gradients(make_config, "full", algorithm, 8)
    for micro in (2, 3):  # 3: uneven micro-batches (3 + 3 + 2 rows)
        # float32 sums in another order (measured up to 2.5e-6 of each tensor's largest entry)
        _assert_same_step(_one_step_gradients(make_config, f"micro{micro}", algorithm, micro), full, lr=1.0)

    # Control: normalising each micro-batch by its own counts (what omitting the global counts
    # does) changes the gradient by far more than the tolerance above.
    wrong, _, _ = _one_step_gradients(make_config, "wrong", algorithm, 2, local_counts=True)
    assert _relative_error(wrong, full[0]) > 0.1  # measured 2.8 to 3


def _without_step_selection(run):
    # What a per-micro-batch selection would do (verl's): the loss picks its tokens from each
    # micro-batch it is given instead of receiving the step's selection.
    run.trainer.cov_selection = lambda *_: None


@pytest.mark.parametrize(
    "name, loss, epochs",
    [
        # every token is in the band and a quarter of them are detached, so the selection matters
        (
            "clip_cov",
            {"policy_loss": "clip_cov", "options": {"clip_cov_ratio": 0.25, "clip_cov_lb": -1e9}},
            1,
        ),
        # the KL-Cov penalty is |log r|: 0 with gradient 0 at the first epoch (r = 1); the second
        # has r != 1 (a small first step, so the float noise of the first epoch's sums, which lr = 1
        # would amplify, stays below the tolerance; the penalty's gradient, sign(log r), does not shrink)
        ("kl_cov", {"policy_loss": "kl_cov", "options": {"kl_cov_ratio": 0.25}}, 2),
        ("positive_lm", {"positive_lm_coef": 0.5}, 1),
    ],
)
def test_micro_batches_do_not_change_the_entropy_losses(name, loss, epochs, make_config):
    """Clip-Cov and KL-Cov select their tokens once over the step's batch, and the positive-example
    LM loss is normalised by the minibatch's count of positive tokens: micro-batches of 2 or 3
    rows give the full batch's gradient (to float32 summation order). Scored by length, so every
    group's samples differ and carry advantages."""
    kw = {"epochs": epochs, "reward_fn": "length_fraction", "lr": 1.0 if epochs == 1 else 1e-3}
    full = _one_step_gradients(make_config, "full", "grpo", 8, loss=loss, **kw)
    for micro in (2, 3):  # measured up to 5.9e-6 of a tensor's largest gradient entry (kl_cov)
        _assert_same_step(
            _one_step_gradients(make_config, f"m{micro}", "grpo", micro, loss=loss, **kw), full, kw["lr"]
        )
    plain, _, _ = _one_step_gradients(make_config, "plain", "grpo", 8, **kw)
    assert _relative_error(plain, full[0]) > 1e-3  # the option changes the gradient
    if name != "positive_lm":  # control: selecting per micro-batch changes it
        hook = _without_step_selection
        wrong, _, _ = _one_step_gradients(make_config, "wrong", "grpo", 2, loss=loss, hook=hook, **kw)
        assert _relative_error(wrong, full[0]) > 1e-3


# ----------------------------------------------------------------------------- non-finite loss


def test_nonfinite_loss_skips_the_update_and_leaves_state_untouched(make_config):
    run = Run(make_config("nan", steps=3, reward_fn="length_fraction"))
    policy_loss = run.trainer.objective.policy_loss

    def nan_on_step_2(logprobs, *args, **kwargs):
        loss, metrics = policy_loss(logprobs, *args, **kwargs)
        return (loss * float("nan") if run.trainer.step_idx == 1 else loss), metrics

    run.trainer.objective.policy_loss = nan_on_step_2
    first = run.trainer.step()
    assert (first["optim/steps"], first["optim/skipped_nonfinite"]) == (1, 0)
    weights, optim_state = model_weights(run.trainer.policy), _optimizer_state(run.trainer.optimizer)
    scheduler_state = run.trainer.scheduler.state_dict()
    skipped = run.trainer.step()
    assert (skipped["optim/steps"], skipped["optim/skipped_nonfinite"]) == (0, 1)
    assert same_tree(model_weights(run.trainer.policy), weights)
    assert same_tree(_optimizer_state(run.trainer.optimizer), optim_state)  # Adam moments and step count
    assert run.trainer.scheduler.state_dict() == scheduler_state
    assert all(p.grad is None for p in run.trainer.policy.parameters())
    third = run.trainer.step()  # training goes on
    assert (third["optim/steps"], third["optim/skipped_nonfinite"]) == (1, 0)
    assert not same_tree(model_weights(run.trainer.policy), weights)


def test_nonfinite_loss_is_logged(make_config):
    run = Run(make_config("nan_logged", steps=2))
    policy_loss = run.trainer.objective.policy_loss

    def inf_loss(*args, **kwargs):
        loss, metrics = policy_loss(*args, **kwargs)
        return loss * float("inf"), metrics

    run.trainer.objective.policy_loss = inf_loss
    with pytest.raises(TrainingError, match="applied no update in 2 steps: every optimizer step was skipped"):
        run.train()  # a run that trains nothing fails loudly, after logging every step
    rows = _metrics_rows(run.run_dir)
    assert [r["optim/skipped_nonfinite"] for r in rows] == [1, 1]
    assert [r["optim/steps"] for r in rows] == [0, 0]
    assert [r["policy/loss"] for r in rows] == [None, None]  # no finite loss to report


# ----------------------------------------------------------------------------- rewards


def test_reward_errors_skipped_are_counted_and_carry_no_loss(make_config, bad_row_dataset):
    run = Run(
        make_config(
            reward_fn="flaky",
            data={"dataset": bad_row_dataset, "shuffle": False},
            reward={"on_error": "skip"},
            loss={"entropy_coef": 0.01},
        )
    )
    spy = Spy(run)
    before = model_weights(run.trainer.policy)
    for _ in range(2):
        m = run.trainer.step()
        # rows 4..7 (the G samples of the bad prompt) are invalid: 4 of 8
        assert m["reward/invalid_frac"] == 0.5 and m["reward/valid_frac"] == 0.5
        assert m["optim/steps"] == 1 and math.isfinite(m["policy/loss"])
    assert not same_tree(model_weights(run.trainer.policy), before)
    for grad, call in zip(spy.grads, spy.calls):
        assert torch.count_nonzero(call["mask"][4:]) == 0
        assert torch.count_nonzero(grad[4:]) == 0
        assert torch.count_nonzero(grad[:4]) > 0


@pytest.mark.parametrize(
    "reward, problem",
    [("flaky", "raised RuntimeError: cannot score this row"), ("not_a_number", "returned 'n/a' (str)")],
)
def test_reward_errors_raise_naming_the_row(reward, problem, make_config, bad_row_dataset):
    run = Run(make_config(reward_fn=reward, data={"dataset": bad_row_dataset, "shuffle": False}))
    with pytest.raises(RewardFunctionError) as info:
        run.trainer.step()
    message = str(info.value)
    assert f":{reward}'" in message and problem in message
    assert "for row 4 (prompt: 'What is 7-4?')" in message and "on_error='skip'" in message


# ----------------------------------------------------------------------------- dynamic sampling


@pytest.mark.parametrize("drop", [False, True])
def test_zero_variance_groups_are_dropped_when_asked(drop, make_config, tmp_path):
    data = write_jsonl(
        tmp_path / "same.jsonl",
        [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "the same: 2+2?", "answer": "4"}],
    )
    run = Run(
        make_config(
            reward_fn="constant_if_same",
            drop_zero_variance_groups=drop,
            data={"dataset": data, "shuffle": False},
            loss={"entropy_coef": 0.01},
        )
    )
    spy = Spy(run)
    m = run.trainer.step()
    assert m["reward/zero_variance_group_frac"] == 0.5
    (grad,) = spy.grads
    # the constant group's advantages are 0, so only the entropy bonus gives its rows a gradient
    assert (torch.count_nonzero(grad[4:]) == 0) == drop
    assert torch.count_nonzero(grad[:4]) > 0


# ----------------------------------------------------------------------------- outputs


def test_train_writes_the_run_directory(make_config):
    trainer = Run(
        make_config(
            "outputs",
            steps=2,
            tensorboard=True,
            eval_before=True,
            eval_after=True,
            data={"eval_size": 3},
            kl={"placement": "reward", "beta": 0.1},
        )
    )
    summary = trainer.train()
    run = trainer.run_dir
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "eval_before.jsonl", "eval_after.jsonl"):
        assert os.path.isfile(os.path.join(run, name)), name
    assert glob.glob(os.path.join(run, "tensorboard", "events.out.tfevents.*"))
    assert os.path.isfile(os.path.join(run, "checkpoints", "step_2", "trainer_state.pt"))
    with open(os.path.join(run, "summary.json"), encoding="utf-8") as f:
        assert json.load(f) == json.loads(json.dumps(summary))
    assert summary["steps"] == 2 and summary["accuracy_before"] == 0.0 and summary["accuracy_after"] == 0.0
    rows = _metrics_rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 2]
    step_row = rows[1]
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        raw = json.loads(f.readlines()[1])
    for key in (
        "reward/mean",
        "reward/std",
        "kl/ref",
        "policy/entropy",
        "policy/clipfrac",
        "policy/approx_kl",
        "response/length_mean",
        "response/length_max",
        "response/truncated_frac",
        "reward/zero_variance_group_frac",
        "reward/invalid_frac",
        "optim/lr",
        "optim/grad_norm",
    ):
        assert key in step_row, key
    for key in ("perf/tokens_per_s", "time/generation_s", "time/training_s", "memory/peak_rss_gb"):
        assert raw[key] >= 0, key
    with open(os.path.join(run, "eval_after.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 3 and set(records[0]) == {"prompt", "answer", "completion", "reward"}


def test_a_row_whose_reward_failed_moves_no_group_statistic(make_config, tmp_path):
    # on_error=skip: the failed row is out of the loss AND out of the group statistics. With every
    # valid reward equal, no advantage may be non-zero (a made-up 0 for the failed row would give
    # the other rows of its group a positive advantage).
    path = tmp_path / "none_first.py"
    path.write_text("def f(prompts, completions, **_):\n    return [None] + [1.0] * (len(completions) - 1)\n")
    cfg = make_config(reward={"functions": [f"{path}:f"], "on_error": "skip"})
    run = Run(cfg)
    m = run.trainer.step()
    assert m["reward/invalid_frac"] == 1 / 8
    assert m["reward/mean"] == 1.0  # over the valid rows only
    assert m["reward/zero_variance_group_frac"] == 1.0
    assert m["optim/grad_norm"] == 0.0


@pytest.mark.parametrize("num_threads", [None, 1])
def test_each_step_logs_its_thread_count_and_changes_none_at_torchs_count(
    num_threads, make_config, monkeypatch
):
    # one_thread (this package's tests): torch's count is 1, so null fits the load within [1, 1]
    run = Run(make_config("threads", num_threads=num_threads))
    calls, real = [], torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    metrics = [run.trainer.step() for _ in range(2)]
    run.close()
    assert [m["perf/threads"] for m in metrics] == [1, 1]
    assert calls == []  # between steps nothing changes torch's count
    assert run.trainer.threads.fixed is (num_threads is not None)


def test_what_the_run_asks_the_trainer_is_answered_from_its_parts():
    # Run reads these instead of the strategy's, policy step's, critic's, stream's or pipeline's attributes.
    trainer = Trainer.__new__(Trainer)  # the parts only, no model
    trainer.strategy = mock.Mock(shards_state=True, saves_alone=False)
    trainer.scheduler = mock.Mock(last_epoch=4)
    trainer.critic_trainer = None
    trainer.config = mock.Mock(
        rollout=mock.Mock(prompts_per_step=3), model=mock.Mock(gradient_checkpointing="auto")
    )
    trainer.stream = mock.Mock(position=2, source=mock.Mock(train_row=lambda i: {"prompt": f"p{i}"}))
    trainer.policy_step = mock.Mock(spec=[])  # no recompute: the config's setting (auto is not True)
    assert trainer.shards_state is True and trainer.saves_alone is False
    assert trainer.optimizer_steps() == (4, 0) and trainer.gradient_checkpointing is False
    trainer.critic_trainer = mock.Mock(scheduler=mock.Mock(last_epoch=7))
    trainer.policy_step = mock.Mock(recompute=mock.Mock(enabled=True))
    assert trainer.optimizer_steps() == (4, 7) and trainer.gradient_checkpointing is True
    assert trainer.next_rows() == [{"prompt": "p2"}, {"prompt": "p3"}, {"prompt": "p4"}]  # read, not taken
    assert trainer.stream.position == 2
    # A second Ctrl-C: a job in flight that does not end within 1 s has its reward worker closed.
    trainer.rollouts, trainer.scorer = mock.Mock(), mock.Mock()
    trainer.rollouts.close.side_effect = [False, True]
    trainer.stop_at_once()
    assert trainer.rollouts.close.call_args_list == [mock.call(timeout=1.0), mock.call(timeout=10.0)]
    trainer.scorer.close.assert_called_once_with()
    trainer.rollouts.close.side_effect = None
    trainer.rollouts.close.return_value = True  # k = 0 (no thread), or a thread that ended: closed at once
    trainer.stop_at_once()
    assert trainer.scorer.close.call_count == 1
    # A new base learning rate under the schedule's position: factor 1 / (2 + 1) at step 2.
    trainer.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda k: 1.0 / (k + 1))
    for _ in range(2):
        trainer.optimizer.step()
        trainer.scheduler.step()
    trainer.set_base_lr(0.3)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1, rel=1e-12)  # 0.3 / 3


# ----------------------------------------------------------------------------- explicit state


def test_the_step_reads_as_its_stages_built_from_named_parts():
    # Trainer.step: at most 40 lines (def to return), one path whatever the staleness, and no
    # global reseed; the trainer takes its parts by name, each declared (no **parts).
    source = inspect.getsource(Trainer.step).rstrip("\n").split("\n")
    assert len(source) <= 40, len(source)
    text = "\n".join(source)
    assert "pipeline" not in text and "max_staleness" not in text and "manual_seed" not in text
    loop_source = inspect.getsource(sys.modules[Trainer.__module__])
    assert "torch.manual_seed" not in loop_source
    params = inspect.signature(Trainer).parameters.values()
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    names = {p.name for p in params}
    assert {"config", "producer", "rollouts", "entropy_ctl", "policy", "optimizer"} <= names
    with pytest.raises(TypeError, match="rollouts"):
        Trainer(**{p.name: None for p in params if p.name != "rollouts"})


def test_a_step_leaves_torch_global_stream_as_it_found_it(make_config):
    # Every draw of a step comes from the run's seeds in scopes of their own: sampling from each
    # prompt's seed, the update's forward passes (dropout) from seeds.step(step), forked.
    run = Run(make_config())
    try:
        torch.manual_seed(99)
        before = torch.get_rng_state()
        run.trainer.step()
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        run.close()


def test_the_entropy_controller_follows_the_update_statistics(make_config):
    run = Run(make_config(loss={"entropy_coef": 0.01, "entropy_target": 1.0, "entropy_coef_delta": 0.005}))
    try:
        t = run.trainer
        # No micro-batch measured an entropy (the policy did not train): it stands still.
        assert t.advance_entropy_controller(UpdateStats()) == {"entropy/coef": 0.01}
        assert t.entropy_ctl.coef == 0.01
        # Entropy before the update 1.5 nats over 3 tokens = 0.5 < target 1.0: coef + delta. The
        # metric is the coefficient the step trained with (0.01).
        below = UpdateStats(entropy_before=[1.5, 3.0])
        assert below.entropy_mean == 0.5
        assert t.advance_entropy_controller(below) == {"entropy/coef": 0.01}
        assert t.objective.entropy_coef == t.entropy_ctl.coef == pytest.approx(0.015, abs=1e-15)
        # 9 nats over 3 tokens = 3.0 >= 1.0: coef - delta, and no bonus while above the target.
        above = UpdateStats(entropy_before=[9.0, 3.0])
        assert t.advance_entropy_controller(above) == {"entropy/coef": pytest.approx(0.015, abs=1e-15)}
        assert t.entropy_ctl.coef == pytest.approx(0.01, abs=1e-15)
        assert t.objective.entropy_coef == t.entropy_ctl.value
    finally:
        run.close()
