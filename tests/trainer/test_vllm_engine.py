"""The training loop on the vLLM engine (skipped where vLLM is not installed): it trains with
weights pushed after every update, reports the mismatch, and a bf16 engine on an fp32 policy
shows a visibly larger mismatch that the sequence-level importance correction then acts on."""

from __future__ import annotations

import pytest
import torch

from policygrad.rollout.vllm import vllm_available
from policygrad.run import Run
from tests.tiny import make_tiny_llama

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not vllm_available(), reason="vllm is not installed"),
]


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory) -> str:
    # head_dim 64 / 2 = 32, a size vLLM's CPU attention kernels support.
    path = tmp_path_factory.mktemp("tiny_llama_vllm")
    make_tiny_llama(
        path, seed=0, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64, initializer_range=0.5
    )
    return str(path)


def _trainer(make_config, name, model_dir, **rollout):
    cfg = make_config(
        name,
        steps=2,
        model={"name": model_dir},
        rollout={"engine": "vllm", "vllm_kv_cache_gb": 0.05, **rollout},
    )
    return Run(cfg)


def test_vllm_engine_trains_and_follows_the_policy(make_config, vllm_model_dir):
    trainer = _trainer(make_config, "fp32", vllm_model_dir)
    try:
        assert trainer.trainer.engine_name == "vllm"
        before = {k: v.clone() for k, v in trainer.trainer.policy.state_dict().items()}
        first = trainer.trainer.step()
        second = trainer.trainer.step()
        # The update moved the policy and the engine was synced: the next step's sampler
        # log-probs still match the trainer's (fp32 engine: ~1e-5), which they would not if the
        # engine still held the old weights (lr 1e-2 moves log-probs by far more than 1e-3).
        assert any(not torch.equal(v, before[k]) for k, v in trainer.trainer.policy.state_dict().items())
        for m in (first, second):
            assert m["mismatch/logprob_abs_max"] < 1e-3
            assert m["optim/steps"] == 1
        assert first["time/weight_sync_s"] > 0
        assert 0.0 < first["mismatch/seq_ratio_min"] <= 1.0 <= first["mismatch/seq_ratio_max"]
    finally:
        trainer.close()


def test_bf16_engine_mismatch_rises_and_sequence_tis_acts(make_config, vllm_model_dir):
    fp32 = _trainer(make_config, "fp32", vllm_model_dir)
    try:
        a = fp32.trainer.step()
    finally:
        fp32.close()
    bf16 = _trainer(
        make_config, "bf16", vllm_model_dir, dtype="bfloat16", is_correction="sequence", is_cap=1.05
    )
    try:
        b = bf16.trainer.step()
    finally:
        bf16.close()
    # bf16 rounds every weight and activation (8 bits of mantissa): per-token log-probs move by
    # ~1e-2 where the fp32 engine agrees to ~1e-5.
    assert b["mismatch/logprob_abs_mean"] > 100 * a["mismatch/logprob_abs_mean"]
    assert b["mismatch/logprob_abs_mean"] > 1e-3
    assert b["mismatch/seq_log_ratio_std"] > 10 * a["mismatch/seq_log_ratio_std"]
    # The sequence-level weights are applied: with a cap of 1.05 some sequence ratios exceed it
    # (their weight is exactly the cap), others fall below 1, so the mean weight is not 1.
    assert b["mismatch/is_capped_frac"] > 0.0
    assert b["mismatch/is_weight_mean"] != pytest.approx(1.0, abs=1e-4)
    assert b["mismatch/is_weight_mean"] <= 1.05 + 1e-6


def test_kl_in_the_reward_uses_the_trainers_logprobs_not_the_samplers(make_config, vllm_model_dir):
    # A bf16 engine's log-probs are ~1e-2 off the trainer's. At step 0 the policy equals the
    # reference, so the KL of the trainer's log-probs to the reference's is ~0; built from the
    # sampler's log-probs it would be the mismatch itself. The trainer therefore runs its own
    # log-prob pass when the KL sits in the reward.
    run = Run(
        make_config(
            "klreward",
            model={"name": vllm_model_dir},
            rollout={"engine": "vllm", "vllm_kv_cache_gb": 0.05, "dtype": "bfloat16"},
            kl={"placement": "reward", "beta": 0.1},
        )
    )
    try:
        m = run.trainer.step()
    finally:
        run.close()
    assert m["time/old_logprobs_s"] > 0
    assert m["mismatch/logprob_abs_mean"] > 1e-3
    assert abs(m["kl/ref"]) < 1e-5
