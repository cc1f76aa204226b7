"""Mixed precision on one device: float32 master weights stepped by AdamW, forwards in bf16 under
autocast (CPU autocast here), against a float32 run and the pure-bf16 opt-in."""

from __future__ import annotations

import pytest
import torch

from policygrad.models.loading import eos_token_ids, load_causal_lm, load_tokenizer
from policygrad.rollout import HFRolloutEngine
from policygrad.run import Run
from policygrad.trainer.precision import resolve_precision

pytestmark = pytest.mark.integration


class FrozenSampler:
    """Samples with a frozen float32 copy of the initial policy, outside any autocast, so runs of
    different precisions train on exactly the same tokens (the comparison is then of the update
    alone, not of which tokens bf16 sampling happened to draw)."""

    shares_policy_weights = False

    def __init__(self, model_dir: str):
        tokenizer = load_tokenizer(model_dir)
        model = load_causal_lm(model_dir, trainable=False)
        self.engine = HFRolloutEngine(model, tokenizer, eos_token_ids(tokenizer, model))

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)

    def sync_weights(self, model) -> None:
        pass


def run_steps(make_config, eos_model_dir, precision: str):
    cfg = make_config(
        precision, steps=3, model={"precision": precision}, optim={"lr": 1e-6, "micro_batch_size": 4}
    )
    run = Run(cfg, engine=FrozenSampler(eos_model_dir))
    before = {k: p.detach().clone() for k, p in run.trainer.policy.named_parameters()}
    metrics = [run.trainer.step() for _ in range(3)]
    after = {k: p.detach().clone() for k, p in run.trainer.policy.named_parameters()}
    return run, before, after, metrics


def test_resolve_precision_defaults():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu).name == "fp32"
    assert resolve_precision("auto", cpu, model_dtype="bfloat16").name == "bf16-mixed"
    mixed = resolve_precision("bf16-mixed", cpu)
    assert (mixed.param_dtype, mixed.autocast_dtype) == (torch.float32, torch.bfloat16)
    assert resolve_precision("bf16-pure", cpu).param_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model.precision='fp16' is not valid"):
        resolve_precision("fp16", cpu)


def test_bf16_mixed_moves_float32_master_weights_like_a_float32_run(make_config, eos_model_dir):
    _, before32, after32, m32 = run_steps(make_config, eos_model_dir, "fp32")
    trainer, before, after, mixed = run_steps(make_config, eos_model_dir, "bf16-mixed")
    assert all(p.dtype == torch.float32 for p in trainer.trainer.policy.parameters())
    state = next(iter(trainer.trainer.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32
    assert all(torch.equal(before[k], before32[k]) for k in before)  # the same start

    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    total = sum(p.numel() for p in before.values())
    assert changed / total >= 0.99, f"only {changed / total:.2%} of the master weights moved"

    # Agreement with the float32 run. bf16 keeps 8 significant bits: every matmul input is rounded
    # with relative error <= u = 2**-9 and the products are accumulated in float32, so a forward
    # quantity (logits, log-probs) carries a relative error of a few u per layer; through 2
    # decoder layers, the head and the backward (another matmul per layer) the per-token
    # gradients carry ~10 roundings, so about 10 * u ~ 2e-2 relative, and the loss (a mean of
    # log-prob ratios times advantages) and the gradient norm the same order: we allow 5e-2.
    # AdamW normalises each coordinate (its first step is lr * sign(g)), so noise moves only the
    # coordinates whose gradient is within that noise of 0; the update as a whole must keep its
    # direction: cosine >= 0.9 and a relative difference ||d_mixed - d_32|| / ||d_32|| <= 0.5,
    # where a sign-random update would give cosine ~0 and relative difference ~1.4.
    for a, b in zip(mixed, m32):
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=5e-2)
        assert a["reward/mean"] == b["reward/mean"]  # the same tokens were scored
    d_mixed = torch.cat([(after[k] - before[k]).flatten() for k in before])
    d_32 = torch.cat([(after32[k] - before32[k]).flatten() for k in before])
    cosine = torch.nn.functional.cosine_similarity(d_mixed, d_32, dim=0).item()
    rel = ((d_mixed - d_32).norm() / d_32.norm()).item()
    assert cosine >= 0.9 and rel <= 0.5, (cosine, rel)


def test_bf16_pure_loses_small_updates(make_config, eos_model_dir):
    """The defect mixed precision fixes: bf16 weights of scale ~0.5 cannot move by lr 1e-6."""
    trainer, before, after, _ = run_steps(make_config, eos_model_dir, "bf16-pure")
    assert all(p.dtype == torch.bfloat16 for p in trainer.trainer.policy.parameters())
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    total = sum(p.numel() for p in before.values())
    assert changed / total < 0.05


@pytest.mark.parametrize("placement", ["loss", "reward"])
@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("fp32", "bfloat16"), ("bf16-mixed", "bfloat16"), ("bf16-pure", "float32"), ("bf16-pure", "bfloat16")],
)
def test_reference_computes_like_the_policy_so_the_first_kl_is_zero(make_config, precision, dtype, placement):
    """Before any update the reference is the policy: the KL between them must be exactly 0 in
    every precision, whatever ``model.dtype`` (the frozen networks' dtype) says. A bf16 reference
    next to float32 master weights under the same autocast gave a k3 loss term of ~6e-3 at step 0.

    The reward placement trains on 2 minibatches, so the behaviour log-probs (those the KL in the
    reward is taken from) come from the policy's own forward, not the sampler's."""
    minibatches = 2 if placement == "reward" else 1
    cfg = make_config(
        f"{precision}-{dtype}-{placement}",
        steps=1,
        model={"precision": precision, "dtype": dtype},
        kl={"placement": placement, "beta": 0.1, "kind": "k3" if placement == "loss" else "k1"},
        optim={"lr": 1e-2, "micro_batch_size": 8, "num_minibatches": minibatches},
    )
    run = Run(cfg)
    try:
        reference = next(run.trainer.reference.parameters())
        assert reference.dtype == next(run.trainer.policy.parameters()).dtype
        metrics = run.trainer.step()
    finally:
        run.close()
    assert metrics["kl/coef"] == 0.1
    if placement == "loss":
        assert metrics["kl/loss_term"] == 0.0
    else:
        assert metrics["kl/ref"] == 0.0
        assert metrics["reward/non_score"] == 0.0
