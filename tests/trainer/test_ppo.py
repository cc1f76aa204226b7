"""PPO with a learned critic: the preset and its options, the analytic properties of GAE with a
critic, the critic's training (value clipping, fitting, pretraining), the N+ details (reward
normalisation, EOS trick, reward whitening, adaptive KL, PPO-ptx, early stop on approx-KL), a
reward model read at the last real token, masking, resume and the recipes.

Every expected number is worked out in the comment next to it."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from policygrad.config.train import ConfigError, load_config
from policygrad.core.advantages import estimate_advantages, monte_carlo_returns
from policygrad.core.masking import masked_mean, masked_var
from policygrad.data.ptx import PtxData
from policygrad.models.forward import lm_loss as ptx_loss
from policygrad.models.loading import load_causal_lm, load_tokenizer
from policygrad.models.swiglu import use_memory_efficient_mlp
from policygrad.rewards.reward_model import RewardModel
from policygrad.run import Run
from tests.models.test_value import PAD_SPIKE, make_tiny_reward_model
from tests.tiny import make_tiny_llama
from tests.trainer.test_loop import comparable, model_weights, poison_masked_positions, same_tree
from tests.training import interrupted_and_resumed, write_jsonl

pytestmark = pytest.mark.integration

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def ppo_sections(**sections) -> dict:
    """Tiny PPO settings on top of the conftest's tiny run (2 prompts x G 4, 6 new tokens)."""
    base = {
        "algorithm": "ppo",
        "critic": {"lr": 1e-2},
        "kl": {"placement": "reward", "beta": 0.1},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


class AdvantageSpy:
    """Records the inputs and outputs of every advantage-estimator call of a trainer (its
    ``estimator`` seam)."""

    def __init__(self, trainer):
        self.calls: list[dict] = []
        estimate = trainer.trainer.estimator

        def spy(token_rewards, response_mask, **kwargs):
            advantages, returns = estimate(token_rewards, response_mask, **kwargs)
            self.calls.append(
                {
                    "token_rewards": token_rewards.clone(),
                    "mask": response_mask.clone(),
                    "values": None if kwargs.get("values") is None else kwargs["values"].clone(),
                    "options": {k: v for k, v in kwargs.items() if k not in ("values", "group_index")},
                    "advantages": advantages.clone(),
                    "returns": returns.clone(),
                }
            )
            return advantages, returns

        spy.spec = estimate.spec
        trainer.trainer.estimator = spy


# ----------------------------------------------------------------------------- preset and config


def test_ppo_is_a_preset_with_a_critic_and_whitening():
    cfg = load_config(None, ["--algorithm=ppo"])
    assert cfg.estimator_name == "gae" and cfg.estimator_options == {"gamma": 1.0, "lam": 0.95}
    assert cfg.policy_loss_name == "ppo" and cfg.agg_mode == "token-mean"
    assert cfg.uses_critic and cfg.whiten_advantages
    assert cfg.estimator_spec.min_group_size(cfg.estimator_options) == 1
    grpo = load_config(None, ["--algorithm=grpo"])
    assert not grpo.uses_critic and not grpo.whiten_advantages
    assert not load_config(None, ["--algorithm=ppo", "--advantage.whiten=false"]).whiten_advantages
    assert load_config(None, ["--algorithm=grpo", "--advantage.whiten=true"]).whiten_advantages
    # decoupled and length-adaptive lam go through advantage.options, merged over the preset's
    cfg = load_config(
        None, ["--algorithm=ppo", "--advantage.options={critic_lam: 1.0, length_adaptive_alpha: 0.05}"]
    )
    assert cfg.estimator_options == {
        "gamma": 1.0,
        "lam": 0.95,
        "critic_lam": 1.0,
        "length_adaptive_alpha": 0.05,
    }


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--advantage.estimator=gae"],
            "advantage estimator 'gae' reads a critic's values, but there is no critic",
        ),
        (["--algorithm=ppo", "--critic.enabled=false"], "reads a critic's values, but there is no critic"),
        (["--critic.pretrain_steps=2"], "critic.pretrain_steps=2 needs a critic"),
        (
            ["--algorithm=ppo", "--critic.pretrain_steps=5", "--steps=5"],
            "critic.pretrain_steps=5 leaves no policy step out of steps=5",
        ),
        (["--ptx.coef=1.0"], "ptx.coef=1.0 needs ptx.dataset"),
        (["--ptx.dataset=text.jsonl"], "ptx.dataset is set but ptx.coef=0 gives it no effect"),
        (
            ["--reward.normalize=zscore"],
            "reward.normalize='zscore' is not valid; choose one of ['fixed_offset', 'none', 'running']",
        ),
        (["--reward.normalize_clip=0"], "reward.normalize_clip must be > 0"),
        (["--optim.target_kl=0"], "optim.target_kl must be > 0"),
        (["--critic.clip_range=-0.2"], "critic.clip_range must be > 0"),
        (["--critic.lr=0"], "critic.lr must be > 0"),
        (["--critic.lora.rank=-1"], "critic.lora.rank must be >= 0"),
        (["--critic.bogus=1"], "unknown config key critic.bogus; valid keys here: clip_range, enabled"),
    ],
)
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_recipes_load_with_their_papers_settings():
    nplus = load_config(os.path.join(CONFIGS, "ppo_nplus.yaml"))
    assert nplus.algorithm == "ppo" and nplus.uses_critic
    assert nplus.estimator_options == {"gamma": 1.0, "lam": 0.95}
    assert (nplus.kl.placement, nplus.kl.kind, nplus.kl.beta, nplus.kl.controller) == (
        "reward",
        "k1",
        0.05,
        "fixed",
    )
    assert nplus.optim.ppo_epochs == 4 and nplus.loss.clip_low == nplus.loss.clip_high == 0.2
    assert nplus.critic.clip_range == 0.2 and nplus.rollout.temperature == 0.7
    assert (nplus.reward.truncation, nplus.reward.truncation_penalty) == ("penalty", -1.0)
    assert nplus.whiten_advantages and nplus.loss.entropy_coef == 0.0
    igpt = load_config(os.path.join(CONFIGS, "ppo_instructgpt.yaml"))
    assert igpt.kl.beta == 0.02 and igpt.optim.ppo_epochs == 1 and igpt.optim.num_minibatches == 8
    assert igpt.rollout.temperature == 1.0
    vc = load_config(os.path.join(CONFIGS, "vcppo.yaml"))
    assert vc.estimator_options["critic_lam"] == 1.0 and vc.estimator_options["lam"] == 0.95
    assert vc.critic.pretrain_steps > 0
    vapo = load_config(os.path.join(CONFIGS, "vapo.yaml"))
    assert (
        vapo.estimator_options["length_adaptive_alpha"] == 0.05
        and vapo.estimator_options["critic_lam"] == 1.0
    )
    assert vapo.loss.clip_high == 0.28 and vapo.agg_mode == "token-mean" and vapo.critic.pretrain_steps > 0
    assert vapo.loss.positive_lm_coef == 0.1


# ----------------------------------------------------------------------------- GAE with a critic


def test_constant_critic_gives_the_closed_form_gae():
    # One row, 3 valid tokens then padding; gamma = 1, lam = 0.5, V = c = 0.5 everywhere.
    # delta_t = r_t + V_{t+1} - V_t: d0 = 0.1 + 0.5 - 0.5 = 0.1, d1 = -0.2, d2 = 1.0 + 0 - 0.5 = 0.5.
    # A2 = 0.5; A1 = -0.2 + 0.5 * 0.5 = 0.05; A0 = 0.1 + 0.5 * 0.05 = 0.125.
    # Closed form: A_t = sum_l lam^l r_{t+l} - lam^(n-1-t) c  (A0 = 0.1 - 0.1 + 0.25 - 0.125 = 0.125).
    rewards = torch.tensor([[0.1, -0.2, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    values = torch.full((1, 4), 0.5)
    adv, ret = estimate_advantages(
        "gae", rewards, mask, group_index=torch.zeros(1, dtype=torch.long), values=values, gamma=1.0, lam=0.5
    )
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.05, 0.5, 0.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(ret, torch.tensor([[0.625, 0.55, 1.0, 0.0]]), rtol=0, atol=1e-7)


def test_lam_one_advantages_depend_on_the_critic_only_through_minus_v():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float32)
    mc = monte_carlo_returns(rewards, mask, gamma=1.0)
    # Hand-worked: row 1 has 2 tokens: G_1 = r_1, G_0 = r_0 + r_1.
    torch.testing.assert_close(mc[1, :2], torch.stack([rewards[1, 0] + rewards[1, 1], rewards[1, 1]]))
    for seed in (1, 2):
        values = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed)) * 3
        adv, ret = estimate_advantages(
            "gae", rewards, mask, group_index=torch.arange(3), values=values, gamma=1.0, lam=1.0
        )
        # A_t = G_t - V(s_t): the critic only enters as a baseline, and the targets are MC returns.
        torch.testing.assert_close(adv, (mc - values) * mask, rtol=0, atol=1e-5)
        torch.testing.assert_close(ret, mc, rtol=0, atol=1e-5)


def test_the_trainer_feeds_the_critic_values_to_gae(make_config):
    # Replace the critic's estimates by a constant c: the advantages the trainer computes are the
    # closed form sum_l lam^l r_{t+l} - lam^(n-1-t) c (gamma = 1), whitened afterwards.
    c, lam = 0.3, 0.5
    run = Run(make_config("constant_critic", **ppo_sections(advantage={"options": {"lam": lam}})))
    run.trainer.critic_trainer.values = lambda rollout: torch.full(rollout.response_ids.shape, c)
    spy = AdvantageSpy(run)
    run.trainer.step()
    call = spy.calls[0]
    r, m = call["token_rewards"], call["mask"] > 0
    assert torch.equal(call["values"], torch.full(r.shape, c))
    expected = torch.zeros_like(r)
    for i in range(r.shape[0]):
        n = int(m[i].sum())
        for t in range(n):
            expected[i, t] = sum(lam**k * r[i, t + k] for k in range(n - t)) - lam ** (n - 1 - t) * c
    torch.testing.assert_close(call["advantages"], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(call["returns"], torch.where(m, expected + c, 0.0), rtol=0, atol=1e-6)


def test_decoupled_and_length_adaptive_lam_reach_the_estimator(make_config):
    # critic_lam = 1: the critic's targets are Monte-Carlo returns; the policy's advantages use
    # lam_i = 1 - 1 / (alpha * n_i) with alpha = 0.5: n = 6 -> 2/3, n = 2 -> 0, n = 1 -> clamped 0.
    options = {"critic_lam": 1.0, "length_adaptive_alpha": 0.5}
    run = Run(make_config("decoupled", **ppo_sections(advantage={"options": options})))
    spy = AdvantageSpy(run)
    run.trainer.step()
    call = spy.calls[0]
    assert call["options"] == {"gamma": 1.0, "lam": 0.95, **options}
    r, m, v = call["token_rewards"], call["mask"], call["values"]
    torch.testing.assert_close(call["returns"], monte_carlo_returns(r, m), rtol=0, atol=1e-6)
    for i in range(r.shape[0]):
        n = int(m[i].sum())
        lam_i = min(max(1 - 1 / (0.5 * n), 0.0), 1.0)
        adv_i, _ = estimate_advantages(
            "gae",
            r[i : i + 1],
            m[i : i + 1],
            group_index=torch.zeros(1, dtype=torch.long),
            values=v[i : i + 1],
            lam=lam_i,
        )
        torch.testing.assert_close(call["advantages"][i], adv_i[0], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- critic training


def test_eos_trick_after_normalisation_in_the_trainer(make_config):
    # Scores are normalised first (fixed offset = mean raw score of step 1), then every truncated
    # completion's score is replaced by exactly -1. length_fraction gives the raw scores (and so the
    # offset) nonzero values; seed 1 samples both truncated and finished completions in each of the
    # two steps (the per-prompt stream of seed 0 truncates nothing in step 2).
    cfg = make_config(
        "eos_trick",
        seed=1,
        reward_fn="length_fraction",
        **ppo_sections(
            reward={"truncation": "penalty", "truncation_penalty": -1.0, "normalize": "fixed_offset"}
        ),
    )
    run = Run(cfg)
    seen = []
    score = run.trainer.scorer
    finish = score.finish  # the half of scoring that normalises and applies the truncation policy

    def spy(out, truncated, group_index, **kwargs):
        seen.append(truncated.clone())
        return finish(out, truncated, group_index, **kwargs)

    score.finish = spy

    def length_fraction(c):
        return len(c) / 40

    offset = None
    for _ in range(2):
        run.trainer.step()
        truncated = seen[-1]
        raw = torch.tensor([length_fraction(s["completion"]) for s in run.trainer.last_samples])
        if offset is None:
            offset = raw.double().mean().item()
        rewards = torch.tensor([s["reward"] for s in run.trainer.last_samples])
        expected = torch.where(truncated, torch.tensor(-1.0), (raw.double() - offset).float())
        torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-6)
    assert score.normalizer.offset == pytest.approx(offset)
    assert truncated.any() and (~truncated).any()  # both cases were exercised


def test_reward_whitening_scales_token_rewards_only(make_config):
    run = Run(
        make_config("reward_whiten", reward_fn="length_fraction", **ppo_sections(reward={"whiten": True}))
    )
    shaped = []
    token_rewards = run.trainer.kl.token_rewards
    run.trainer.kl = copy.copy(run.trainer.kl)  # the registered placement, with a recording token_rewards
    run.trainer.kl.token_rewards = lambda *a, **k: shaped.append(token_rewards(*a, **k)) or shaped[-1]
    spy = AdvantageSpy(run)
    metrics = run.trainer.step()
    before, after, mask = shaped[0], spy.calls[0]["token_rewards"], spy.calls[0]["mask"]
    # N+ reward whitening: unit (unbiased) variance over the valid tokens, mean kept.
    assert float(masked_var(after, mask)) == pytest.approx(1.0, abs=1e-5)
    assert float(masked_mean(after, mask)) == pytest.approx(float(masked_mean(before, mask)), abs=1e-6)
    # reward/score + reward/non_score is the mean summed token reward before whitening
    total = (before * mask).sum(-1).mean().item()
    assert metrics["reward/score"] + metrics["reward/non_score"] == pytest.approx(total, abs=1e-6)


# ----------------------------------------------------------------------------- adaptive KL


def test_adaptive_kl_moves_beta_toward_the_target(make_config):
    # e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * B / horizon), B = 8, horizon 10.
    cfg = make_config(
        "adaptive",
        steps=3,
        **ppo_sections(kl={"controller": "adaptive", "target": 0.05, "horizon": 10.0}),
    )
    run = Run(cfg)
    measured = []
    update = run.trainer.kl_ctl.update
    run.trainer.kl_ctl.update = lambda kl, n: measured.append((kl, n)) or update(kl, n)
    coefs = [run.trainer.step()["kl/coef"] for _ in range(3)]
    assert coefs[0] == 0.1
    for k in range(2):
        kl, n = measured[k]
        e = min(max(kl / 0.05 - 1, -0.2), 0.2)
        assert n == 8 and coefs[k + 1] == pytest.approx(coefs[k] * (1 + e * 8 / 10), rel=1e-12)
    # Far below a huge target the error saturates at -0.2: beta shrinks by 1 - 0.2 * 0.8 = 0.84.
    far = Run(
        make_config("far", **ppo_sections(kl={"controller": "adaptive", "target": 1e4, "horizon": 10.0}))
    )
    far.trainer.step()
    assert far.trainer.step()["kl/coef"] == pytest.approx(0.1 * 0.84, rel=1e-12)


# ----------------------------------------------------------------------------- PPO-ptx


@pytest.fixture
def zero_policy_dir(tmp_path) -> str:
    """A tiny Llama whose embeddings (tied to the output head) are all zero: every hidden state
    and every logit is 0, so the model is the uniform distribution over its 100 tokens."""
    model, tokenizer = make_tiny_llama(None, seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
    model.save_pretrained(tmp_path / "zero")
    tokenizer.save_pretrained(tmp_path / "zero")
    return str(tmp_path / "zero")


@pytest.fixture
def ptx_jsonl(tmp_path) -> str:
    return write_jsonl(
        tmp_path / "ptx.jsonl",
        [{"text": "The sum of 2 and 3 is 5."}, {"text": "Seven minus four is three."}, {"text": "ok"}],
    )


def test_ptx_loss_of_a_uniform_model_is_log_vocabulary(zero_policy_dir, ptx_jsonl):
    model = load_causal_lm(zero_policy_dir)
    data = PtxData(ptx_jsonl, load_tokenizer(zero_policy_dir), batch_size=3)
    ids, mask = data.next_batch()
    # uniform over V = 100 tokens: -log(1/100) = 4.6051702 per predicted token
    assert float(ptx_loss(model, ids, mask).detach()) == pytest.approx(math.log(100), abs=1e-5)
    assert mask.sum(-1).tolist() == [24, 26, 2]  # right-padded: one token per character
    assert data.position == 3 and data.next_batch()[1].sum(-1).tolist() == [24, 26, 2]  # wraps around


def test_ptx_loss_in_the_trainer(zero_policy_dir, ptx_jsonl, make_config):
    cfg = make_config(
        "ptx_uniform",
        model={"name": zero_policy_dir},
        ptx={"dataset": ptx_jsonl, "coef": 27.8, "batch_size": 2},
    )
    metrics = Run(cfg).trainer.step()
    # one optimizer step, the ptx loss measured before it on the uniform model: log(100)
    assert metrics["optim/steps"] == 1
    assert metrics["ptx/loss"] == pytest.approx(math.log(100), abs=1e-5)


def test_ptx_gradient_is_coef_times_the_lm_gradient(make_config, ptx_jsonl, tmp_path):
    # A constant reward gives GRPO advantages of exactly 0, so the policy term has no gradient and
    # the step's gradient is exactly coef * grad(L_ptx) on the first ptx batch.
    constant = tmp_path / "constant.py"
    constant.write_text("def one(prompts, completions, **f):\n    return [1.0] * len(completions)\n")
    coef = 2.5
    cfg = make_config(
        "ptx_grad",
        reward={"functions": [f"{constant}:one"]},
        ptx={"dataset": ptx_jsonl, "coef": coef, "batch_size": 2},
        optim={"max_grad_norm": 1e9},
    )
    run = Run(cfg)
    fresh = load_causal_lm(run.trainer.model_path)
    use_memory_efficient_mlp(fresh)  # the trainer's layers, so float32 rounding is the same
    ids, mask = PtxData(ptx_jsonl, run.trainer.tokenizer, batch_size=2).next_batch()
    (coef * ptx_loss(fresh, ids, mask)).backward()
    grads = {}
    run.trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.clone() for n, p in run.trainer.policy.named_parameters()})
    )
    run.trainer.step()
    expected = dict(fresh.named_parameters())
    assert grads and all(torch.allclose(g, expected[n].grad, rtol=1e-4, atol=1e-7) for n, g in grads.items())
    assert any(g.abs().sum() > 0 for g in grads.values())


# ----------------------------------------------------------------------------- early stop, pretraining


def test_early_stop_when_approx_kl_exceeds_the_target(make_config):
    # The first minibatch is on-policy up to float rounding and steps: its old log-probs come from
    # the inference forward, which groups the rows into other micro-batches, so they differ from the
    # training forward's in the last bits (<= 1.2e-5, see test_first_minibatch_ratio_is_one) and
    # approx_kl = mean k3 ~ d^2 / 2 is not exactly 0 (measured 1.5e-11). After that step the second
    # minibatch's approx-KL is > 1e-6 (measured >= 4 at lr 5e-2): no step, and the remaining 5
    # minibatches are skipped.
    sections = ppo_sections(optim={"ppo_epochs": 3, "num_minibatches": 2, "target_kl": 1e-6, "lr": 5e-2})
    metrics = Run(make_config("early_stop", reward_fn="length_fraction", **sections)).trainer.step()
    assert metrics["optim/steps"] == 1 and metrics["optim/early_stopped"] == 1.0
    assert metrics["critic/steps"] == 1  # the critic stops with the policy
    sections["optim"]["target_kl"] = 1e9
    metrics = Run(make_config("no_stop", reward_fn="length_fraction", **sections)).trainer.step()
    assert (
        metrics["optim/steps"] == 6 and metrics["optim/early_stopped"] == 0.0 and metrics["critic/steps"] == 6
    )


def test_value_pretraining_freezes_the_policy_and_fits_monte_carlo_returns(make_config):
    # An adaptive controller far below its target would shrink beta by 0.84 per step; while the
    # policy is frozen it must stand still.
    kl = {"controller": "adaptive", "target": 1e4, "horizon": 10.0}
    sections = ppo_sections(critic={"pretrain_steps": 1}, optim={"ppo_epochs": 2}, kl=kl)
    run = Run(make_config("pretrain", steps=3, **sections))
    policy0, critic0 = model_weights(run.trainer.policy), model_weights(run.trainer.critic)
    fitted = []
    fit = run.trainer.critic_trainer.fit
    run.trainer.critic_trainer.fit = lambda mb, **kw: fitted.append(mb.returns.clone()) or fit(mb, **kw)
    spy = AdvantageSpy(run)
    m1 = run.trainer.step()
    assert m1["critic/pretraining"] == 1.0 and m1["optim/steps"] == 0 and m1["critic/steps"] == 2
    assert same_tree(model_weights(run.trainer.policy), policy0)  # policy frozen
    assert not same_tree(model_weights(run.trainer.critic), critic0)  # critic trained
    call = spy.calls[0]
    # the targets are the lam = 1 (Monte-Carlo) returns, not the lam = 0.95 GAE returns
    torch.testing.assert_close(
        fitted[0], monte_carlo_returns(call["token_rewards"], call["mask"]), rtol=0, atol=0
    )
    assert not torch.allclose(call["returns"], fitted[0])
    assert run.trainer.kl_ctl.value == 0.1
    m2 = run.trainer.step()
    assert m2["critic/pretraining"] == 0.0 and m2["optim/steps"] == 2
    assert not same_tree(model_weights(run.trainer.policy), policy0)
    assert run.trainer.kl_ctl.value == pytest.approx(0.1 * 0.84, rel=1e-12)


# ----------------------------------------------------------------------------- end to end


def test_two_ppo_steps_with_a_reward_model_read_at_the_last_real_token(make_config, tmp_path):
    # The reward model returns ~5.7e6 at padding positions; it also initialises the critic (as
    # InstructGPT did), so its values at post-EOS padding columns are huge too. Neither may leak.
    rm_dir = tmp_path / "rm"
    make_tiny_reward_model(rm_dir, seed=2, pad_spike=PAD_SPIKE)
    cfg = make_config(
        "ppo_rm",
        **ppo_sections(
            reward={
                "functions": [f"reward_model:{rm_dir}"],
                "model_chat_template": False,
                "model_batch_size": 3,
            },
            # a tiny lr: this critic's head has a weight of 1e6, so any real training would make
            # its values large for reasons that have nothing to do with padding
            critic={"init_from": str(rm_dir), "clip_range": 0.2, "lr": 1e-9},
            optim={"ppo_epochs": 2, "num_minibatches": 2},
        ),
    )
    run = Run(cfg)
    alone = RewardModel.from_pretrained(str(rm_dir), use_chat_template=False, batch_size=1)
    for _ in range(2):
        metrics = run.trainer.step()
        samples = run.trainer.last_samples
        expected = [alone([s["prompt"]], [s["completion"]])[0] for s in samples]
        assert [s["reward"] for s in samples] == pytest.approx(expected, abs=1e-4)
        assert all(abs(s["reward"]) < 100 for s in samples)
        assert metrics["optim/steps"] == 4 and metrics["critic/steps"] == 4
        for key in (
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/explained_variance",
            "critic/values_mean",
            "returns/mean",
            "kl/coef",
            "reward/non_score",
            "reward/score",
            "memory/peak_rss_gb",
        ):
            assert math.isfinite(metrics[key]), key
        assert abs(metrics["critic/values_mean"]) < 100 and abs(metrics["returns/mean"]) < 100
        assert abs(metrics["critic/vf_loss"]) < 1e4
    assert len({round(s["reward"], 4) for s in run.trainer.last_samples}) > 1


def test_masked_positions_carry_nothing_in_ppo(make_config):
    # Garbage in every masked position (prompt padding, post-EOS tokens, NaN log-probs) must give
    # bitwise the same policy and critic after a step as a clean run.
    sections = ppo_sections(optim={"ppo_epochs": 2, "num_minibatches": 2}, critic={"clip_range": 0.2})
    clean = Run(make_config("clean", **sections))
    clean.trainer.step()
    dirty = Run(make_config("dirty", **sections))
    poison_masked_positions(dirty)
    dirty.trainer.step()
    assert same_tree(model_weights(dirty.trainer.policy), model_weights(clean.trainer.policy))
    assert same_tree(model_weights(dirty.trainer.critic), model_weights(clean.trainer.critic))


def test_resume_restores_the_critic_and_normalizer(make_config, monkeypatch):
    sections = ppo_sections(
        steps=3,
        reward={"normalize": "running"},
        optim={"ppo_epochs": 2, "num_minibatches": 2, "schedule": "cosine"},
        critic={"clip_range": 0.2},
    )
    straight, cfg, resumed = interrupted_and_resumed(make_config, monkeypatch, sections, dies_at=2)
    assert same_tree(model_weights(resumed.trainer.critic), model_weights(straight.trainer.critic))
    assert same_tree(model_weights(resumed.trainer.policy), model_weights(straight.trainer.policy))
    assert resumed.trainer.scorer.normalizer.state_dict() == straight.trainer.scorer.normalizer.state_dict()
    a, b = resumed.trainer.critic_trainer, straight.trainer.critic_trainer
    assert same_tree(a.state_dict(), b.state_dict())
    saved = load_file(
        os.path.join(cfg.output_dir, "checkpoints", "step_3", "critic", "value_model.safetensors")
    )
    assert "head.weight" in saved

    def rows(run_dir):
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            return [comparable(json.loads(line)) for line in f]

    assert rows(cfg.output_dir) == rows(straight.run_dir)


# ----------------------------------------------------------------------------- memory


@pytest.mark.slow
@pytest.mark.usefixtures("bundled_model")
def test_policy_reference_and_critic_of_smollm2_fit_in_memory(tmp_path):
    # Policy + reference + critic of SmolLM2-135M in float32: one PPO step, peak RSS well under
    # the 24 GiB machine.
    cfg = load_config(
        os.path.join(CONFIGS, "ppo_nplus.yaml"),
        {
            "steps": 1,
            "output_dir": str(tmp_path / "mem"),
            "eval_before": False,
            "eval_after": False,
            "progress": False,
            "tensorboard": False,
            "rollout": {"prompts_per_step": 8, "max_new_tokens": 16},
            "optim": {"ppo_epochs": 1},
        },
    )
    metrics = Run(cfg).trainer.step()
    assert metrics["critic/steps"] == 1 and metrics["optim/steps"] == 1
    assert metrics["memory/peak_rss_gb"] < 20
    print(f"peak RSS, policy + reference + critic of SmolLM2-135M: {metrics['memory/peak_rss_gb']:.2f} GB")
