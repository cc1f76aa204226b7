"""Mixed precision on one device: float32 master weights stepped by AdamW, forwards in bf16 under
autocast (CPU autocast here), against a float32 run and the pure-bf16 opt-in."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from policygrad.config.train import ConfigError
from policygrad.models.forward import Float32Head
from policygrad.models.loading import eos_token_ids, load_causal_lm, load_tokenizer

# cpu_has_fast_bf16 bound at import: the real one (conftest patches the module's attribute)
from policygrad.parallel.precision import cpu_has_fast_bf16, resolve_precision
from policygrad.rollout import HFRolloutEngine
from policygrad.run import Run
from tests.training import interrupted_and_resumed

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
    assert resolve_precision("auto", cpu).name == "fp32"  # conftest: as on a CPU without bf16 instructions
    assert resolve_precision("auto", cpu, fast_cpu_bf16=False).name == "fp32"
    assert resolve_precision("auto", cpu, fast_cpu_bf16=True).name == "bf16-mixed"
    assert resolve_precision("auto", cpu, model_dtype="bfloat16").name == "bf16-mixed"
    mixed = resolve_precision("bf16-mixed", cpu)
    assert (mixed.param_dtype, mixed.autocast_dtype) == (torch.float32, torch.bfloat16)
    assert resolve_precision("bf16-pure", cpu).param_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model.precision='fp16' is not valid"):
        resolve_precision("fp16", cpu)


def test_cpu_has_fast_bf16_reads_the_flags_line():
    # Zen 4 / Sapphire Rapids list avx512_bf16 (and amx_bf16); an AVX2-only CPU lists neither,
    # and a flag that merely starts like one (avx512bw) does not count.
    zen4 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"
    spr = "flags\t\t: avx2 amx_bf16 amx_tile\n"
    avx2 = "flags\t\t: fpu sse avx avx2 fma avx512bw\n"
    assert cpu_has_fast_bf16(zen4)
    assert cpu_has_fast_bf16(spr)
    assert not cpu_has_fast_bf16(avx2)
    assert not cpu_has_fast_bf16("")  # no flags line (not x86, or no /proc)
    assert not cpu_has_fast_bf16("bugs\t: avx512_bf16\n")  # only the flags line counts


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


# ----------------------------------------------------------------------------- fp32 head, fp16-mixed


def test_resolve_precision_fp16_and_the_head():
    cpu = torch.device("cpu")
    fp16 = resolve_precision("fp16-mixed", cpu)  # torch's CPU autocast has float16
    assert (fp16.param_dtype, fp16.autocast_dtype, fp16.loss_scaling) == (torch.float32, torch.float16, True)
    assert isinstance(fp16.grad_scaler(), torch.amp.GradScaler) and fp16.grad_scaler().get_scale() == 2.0**16
    mixed = resolve_precision("bf16-mixed", cpu)
    assert mixed.head_dtype is None and mixed.grad_scaler() is None and not mixed.loss_scaling
    assert resolve_precision("bf16-mixed", cpu, lm_head_dtype="float32").head_dtype == torch.float32
    assert resolve_precision("fp16-mixed", cpu, lm_head_dtype="float32").head_dtype == torch.float32
    # fp32: the head already is float32 -> accepted, nothing to do (no class swap).
    assert resolve_precision("fp32", cpu, lm_head_dtype="float32") == resolve_precision("fp32", cpu)
    assert resolve_precision("auto", cpu, lm_head_dtype=None) == resolve_precision("auto", cpu)
    with pytest.raises(ConfigError, match="model.lm_head_dtype=float32 with model.precision=bf16-pure"):
        resolve_precision("bf16-pure", cpu, lm_head_dtype="float32")
    with pytest.raises(ValueError, match="model.lm_head_dtype='float16' is not valid"):
        resolve_precision("bf16-mixed", cpu, lm_head_dtype="float16")


def test_fp16_mixed_is_refused_where_autocast_has_no_float16(monkeypatch):
    import policygrad.parallel.precision as precision

    monkeypatch.setattr(precision, "unsupported_reason", lambda *_: "no float16 here")
    with pytest.raises(
        ConfigError,
        match=r"^model.precision=fp16-mixed needs float16 autocast \(no float16 here\); use a GPU",
    ):
        precision.resolve_precision("fp16-mixed", torch.device("cpu"))


def test_config_names_the_head_field_and_refuses_it_with_bf16_pure(make_config):
    with pytest.raises(
        ConfigError, match=r"model.lm_head_dtype='bf16' is not valid; choose one of \['auto', 'float32'\]"
    ):
        make_config(model={"lm_head_dtype": "bf16"})
    with pytest.raises(ConfigError, match="model.lm_head_dtype=float32 with model.precision=bf16-pure"):
        make_config(model={"lm_head_dtype": "float32", "precision": "bf16-pure"})
    assert make_config(model={"lm_head_dtype": None}).model.lm_head_dtype is None  # YAML null: auto
    assert make_config().model.lm_head_dtype == "auto"


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_fp32_head_run_gives_policy_reference_and_sampler_the_float32_head(make_config, precision):
    """The policy, the reference and the hf engine (sampling with the live policy) all carry the
    float32 head, so the reference computes as the policy does and the first KL is exactly 0."""
    cfg = make_config(
        f"head-{precision}",
        steps=1,
        model={"precision": precision, "lm_head_dtype": "float32"},
        kl={"placement": "loss", "beta": 0.1, "kind": "k3"},
    )
    run = Run(cfg)
    try:
        trainer = run.trainer
        assert type(trainer.policy.lm_head) is Float32Head and type(trainer.reference.lm_head) is Float32Head
        assert trainer.engine.model is trainer.policy
        metrics = trainer.step()
    finally:
        run.close()
    assert metrics["kl/loss_term"] == 0.0
    assert ("optim/loss_scale" in metrics) == (precision == "fp16-mixed")


def test_fp32_head_with_lora_reference_is_the_policy_with_adapters_off(make_config):
    """A LoRA run's reference is the policy itself with the adapter disabled: it shares the
    float32 head (the base model's, not adapted), and the first KL is exactly 0."""
    cfg = make_config(
        "head-lora",
        steps=1,
        model={"precision": "bf16-mixed", "lm_head_dtype": "float32", "lora": {"rank": 4, "alpha": 8.0}},
        kl={"placement": "loss", "beta": 0.1, "kind": "k3"},
    )
    run = Run(cfg)
    try:
        assert run.trainer.reference is None
        assert type(run.trainer.policy.get_base_model().lm_head) is Float32Head
        metrics = run.trainer.step()
    finally:
        run.close()
    assert metrics["kl/loss_term"] == 0.0 and metrics["optim/steps"] == 1


def test_default_head_is_the_plain_linear(make_config):
    run = Run(make_config(model={"precision": "bf16-mixed"}))
    try:
        assert type(run.trainer.policy.lm_head) is torch.nn.Linear
        assert run.trainer.policy_step.step.scaler is None
    finally:
        run.close()


def test_fp16_mixed_moves_float32_master_weights_like_a_float32_run(make_config, eos_model_dir):
    """fp16-mixed trains the float32 master weights in the direction of a float32 run. fp16 keeps
    11 significant bits (unit roundoff 2**-11 = 4.9e-4, 8x finer than bf16's 2**-8), so the same
    bounds as bf16-mixed's test hold with room: grad norm within 5e-2, update cosine >= 0.9."""
    _, before32, after32, m32 = run_steps(make_config, eos_model_dir, "fp32")
    run, before, after, fp16 = run_steps(make_config, eos_model_dir, "fp16-mixed")
    assert all(p.dtype == torch.float32 for p in run.trainer.policy.parameters())
    assert run.trainer.policy_step.step.scaler is not None
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    assert changed / sum(p.numel() for p in before.values()) >= 0.99
    for a, b in zip(fp16, m32):
        assert a["optim/steps"] == 1 and a["optim/skipped_nonfinite"] == 0
        assert a["optim/loss_scale"] == 2.0**16  # no overflow; growth only after 2000 clean steps
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=5e-2)
        assert "optim/loss_scale" not in b
    d16 = torch.cat([(after[k] - before[k]).flatten() for k in before])
    d32 = torch.cat([(after32[k] - before32[k]).flatten() for k in before])
    cosine = torch.nn.functional.cosine_similarity(d16, d32, dim=0).item()
    assert cosine >= 0.9, cosine


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_fp16_mixed_resume_restores_the_loss_scale_exactly(make_config, monkeypatch, algorithm):
    """A scaler that grows every step (growth_interval 1, from 2**13) makes the scale a function
    of the whole history: 2**14, 2**15, ... until fp16 gradients overflow, when a step is skipped
    and the scale halves. A resume that lost the scaler's state would restart at 2**13 and log a
    different optim/loss_scale (and skip other steps): resumed must equal straight."""
    from policygrad.parallel.precision import Precision

    monkeypatch.setattr(
        Precision,
        "grad_scaler",
        lambda self: (
            torch.amp.GradScaler(self.device_type, init_scale=2.0**13, growth_interval=1)
            if self.loss_scaling
            else None
        ),
    )
    sections = {
        "steps": 4,
        "model": {"precision": "fp16-mixed"},
        "optim": {"lr": 1e-3, "micro_batch_size": 4},
    }
    if algorithm == "ppo":  # the critic's own scaler is saved with the critic's state
        sections.update(algorithm="ppo", critic={"lr": 1e-2}, kl={"placement": "reward", "beta": 0.1})
    straight, cfg, resumed = interrupted_and_resumed(make_config, monkeypatch, sections, dies_at=3)
    rows, straight_rows = _metrics_rows(cfg.output_dir), _metrics_rows(straight.run_dir)
    assert rows == straight_rows
    scales = [r["optim/loss_scale"] for r in straight_rows if "optim/loss_scale" in r]
    assert len(scales) == 4 and scales[0] == 2.0**14 and len(set(scales)) > 1
    a, b = resumed.trainer.policy_step.step.scaler, straight.trainer.policy_step.step.scaler
    assert a.state_dict() == b.state_dict()
    if algorithm == "ppo":
        a, b = resumed.trainer.critic_trainer, straight.trainer.critic_trainer
        assert a.step.scaler.state_dict() == b.step.scaler.state_dict()
        assert a.state_dict()["grad_scaler"]["scale"] == b.step.scaler.get_scale() != 2.0**13
        for x, y in zip(resumed.trainer.critic.parameters(), straight.trainer.critic.parameters()):
            assert torch.equal(x, y)
    for x, y in zip(resumed.trainer.policy.parameters(), straight.trainer.policy.parameters()):
        assert torch.equal(x, y)


def _metrics_rows(run_dir) -> list[dict]:
    volatile = ("time/", "memory/", "perf/")
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [
        {
            k: ("nan" if isinstance(v, float) and math.isnan(v) else v)
            for k, v in r.items()
            if not k.startswith(volatile)
        }
        for r in rows
    ]


def test_resume_keeps_the_precision_the_checkpoint_was_trained_in():
    from policygrad.parallel.precision import resumed_precision

    cpu = torch.device("cpu")
    # a checkpoint trained in fp32 resumed on a CPU with bf16 instructions stays fp32
    name, fast = resumed_precision("auto", "fp32")
    assert resolve_precision(name, cpu, fast_cpu_bf16=fast).name == "fp32"
    name, fast = resumed_precision("auto", "bf16-mixed")
    assert resolve_precision(name, cpu, fast_cpu_bf16=fast).name == "bf16-mixed"
    # a checkpoint that records none: auto meant fp32 on CPUs when it was written
    name, fast = resumed_precision("auto", None)
    assert (name, fast) == ("auto", False)
    assert resolve_precision(name, cpu, fast_cpu_bf16=fast).name == "fp32"
    assert resolve_precision(name, cpu, model_dtype="bfloat16", fast_cpu_bf16=fast).name == "bf16-mixed"
    # an explicit choice is the user's
    assert resumed_precision("bf16-mixed", "fp32") == ("bf16-mixed", None)
