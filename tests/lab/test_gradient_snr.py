"""Tests of the gradient-SNR lab on a tiny model: a reward offset ruins the no-baseline estimator
and leaves every baseline-corrected one unchanged; grouping, parsing, parameter subsets."""

from __future__ import annotations

import json

import pytest

from policygrad.lab.gradient_snr import run_gradient_snr

pytestmark = pytest.mark.integration

PROMPTS = ["What is 2+3?", "Say hi."]


def even_first_char(_prompts, completions, **_fields):
    """1.0 when the completion's first character has an even code point: a reward decided by the
    first sampled token, so the policy gradient is large next to its noise."""
    return [float(len(c) > 0 and ord(c[0]) % 2 == 0) for c in completions]


SETTINGS = dict(
    estimators="none,rloo2,rloo4,grpo,gae0,gae1",
    samples_per_prompt=8,
    draws=24,
    reference_draws=12,
    critic_draws=2,
    max_new_tokens=2,
    params="last-layer",
    seed=0,
)


@pytest.fixture(scope="module")
def runs(tiny_lm, tmp_path_factory):
    model, tokenizer = tiny_lm
    out = tmp_path_factory.mktemp("snr")
    plain = run_gradient_snr(model, tokenizer, PROMPTS, even_first_char, output_dir=None, **SETTINGS)
    offset = run_gradient_snr(
        model, tokenizer, PROMPTS, even_first_char, reward_offset=10.0, output_dir=str(out), **SETTINGS
    )
    return plain, offset


def test_offset_makes_no_baseline_noisier_than_rloo(runs):
    _, offset = runs
    # A constant c adds about c^2 E||grad log p||^2 to the no-baseline variance and nothing to
    # RLOO's, whose leave-one-out baseline (Kool et al. 2019) cancels it.
    assert offset.stats("no-baseline").snr < offset.stats("rloo(k=4)").snr
    assert offset.stats("no-baseline").noise > 20 * offset.stats("rloo(k=4)").noise


def test_baselines_are_invariant_to_the_offset(runs):
    plain, offset = runs
    # Same seeds -> same samples; RLOO and GRPO subtract the group mean and the critic's bias
    # absorbs the constant, so their gradients are unchanged up to float32 rounding.
    for name in ("rloo(k=2)", "rloo(k=4)", "grpo", "gae(lam=0)", "gae(lam=1)"):
        assert offset.stats(name).snr == pytest.approx(plain.stats(name).snr, rel=1e-3), name
        assert offset.stats(name).grad_norm == pytest.approx(plain.stats(name).grad_norm, rel=1e-3), name
    assert offset.stats("no-baseline").noise > plain.stats("no-baseline").noise
    assert offset.reward_mean == pytest.approx(plain.reward_mean + 10.0, abs=1e-5)


def test_result_fields_and_files(runs, tiny_lm):
    _, offset = runs
    model, _ = tiny_lm
    names = [e.name for e in offset.estimators]
    assert names == ["no-baseline", "rloo(k=2)", "rloo(k=4)", "grpo", "gae(lam=0)", "gae(lam=1)"]
    last = [p for n, p in model.named_parameters() if "layers.1." in n]
    assert offset.num_params == sum(p.numel() for p in last)
    for e in offset.estimators:
        assert e.draws == 24 and e.samples_per_batch == 16
        assert -1.0 <= e.cos_ref <= 1.0 and -1.0 <= e.cos_mean_ref <= 1.0
        assert e.snr >= 0.0 and e.snr_raw >= e.snr
    assert offset.critic_ev_fit is not None and offset.critic_ev_fit <= 1.0
    data = json.loads(open(offset.json_path).read())
    assert data["reward_offset"] == 10.0 and len(data["estimators"]) == 6
    assert open(offset.png_path, "rb").read(4) == b"\x89PNG"
    assert "rloo(k=4)" in offset.table
    # The model is left as it was: every parameter trainable (make_tiny_llama's default).
    assert all(p.requires_grad for p in model.parameters())


def test_bad_settings(tiny_lm):
    model, tokenizer = tiny_lm
    with pytest.raises(ValueError, match="not a multiple of k=4"):
        run_gradient_snr(
            model,
            tokenizer,
            PROMPTS,
            even_first_char,
            estimators="rloo4",
            samples_per_prompt=6,
            output_dir=None,
        )
    with pytest.raises(ValueError, match="draws must be >= 2"):
        run_gradient_snr(model, tokenizer, PROMPTS, even_first_char, draws=1, output_dir=None)
    with pytest.raises(ValueError, match="reward_fn returned 1 scores for 4 completions"):
        run_gradient_snr(
            model,
            tokenizer,
            ["Hi"],
            lambda _p, _c, **_f: [0.0],
            estimators="rloo2",
            samples_per_prompt=4,
            draws=2,
            reference_draws=2,
            max_new_tokens=2,
            output_dir=None,
        )
