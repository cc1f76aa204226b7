"""The models of a run, with the tiny Llama: the policy and its frozen reference (a copy of the
starting weights, the LoRA base, or none), checkpoint weights, a caller's model object adopted
(written to ``start_model`` without a folder), the evaluation model, and how a model object is
recorded in the config."""

from __future__ import annotations

import os

import pytest
import torch

from policygrad.config.train import ConfigError, ModelConfig
from policygrad.run.checkpoint import CheckpointError
from policygrad.trainer.models import adopt_model, build_models, load_eval_models, record_model_object
from tests.tiny import EOS_ID, make_tiny_llama
from tests.training import config_with

pytestmark = pytest.mark.integration

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny-model work on one thread (tests/conftest.py)."""


_config = config_with


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_kl_run_gets_a_frozen_reference_equal_to_the_policy(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, kl={"placement": "loss", "beta": 0.04})
    m = build_models(cfg, device=CPU, dtype=torch.float32, checkpoint=None)
    assert m.model_path == tiny_model_dir and not m.weights_differ_from_path and m.policy_as_reference is None
    assert m.reference is not m.policy and _same_weights(m.reference, m.policy)
    assert all(p.requires_grad for p in m.policy.parameters())
    assert not any(p.requires_grad for p in m.reference.parameters()) and not m.reference.training
    assert m.policy.training and EOS_ID in m.eos_ids
    assert m.tokenizer.padding_side == "left"


def test_no_reference_without_a_kl(tmp_path, tiny_model_dir):
    m = build_models(_config(tmp_path, tiny_model_dir), device=CPU, dtype=torch.float32, checkpoint=None)
    assert m.reference is None and m.policy_as_reference is None


def test_policy_dtype_sets_the_policys_and_the_references_parameters(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, tiny_model_dir, kl={"placement": "loss", "beta": 0.04})
    m = build_models(cfg, device=CPU, dtype=torch.bfloat16, checkpoint=None, policy_dtype=torch.float32)
    assert {p.dtype for p in m.policy.parameters()} == {torch.float32}
    assert {p.dtype for p in m.reference.parameters()} == {torch.float32}


def test_a_checkpoint_loads_into_the_policy_but_the_reference_stays_the_start(tmp_path, tiny_model_dir):
    trained, _ = make_tiny_llama(seed=5)
    ckpt = tmp_path / "ckpt"
    trained.save_pretrained(ckpt / "model")
    cfg = _config(tmp_path, tiny_model_dir, kl={"placement": "loss", "beta": 0.04})
    m = build_models(cfg, device=CPU, dtype=torch.float32, checkpoint=str(ckpt))
    start, _ = make_tiny_llama(seed=0)
    assert _same_weights(m.policy, trained) and _same_weights(m.reference, start)
    make_tiny_llama(tmp_path / "wide_ckpt" / "model", num_layers=3)  # a layer the policy lacks
    with pytest.raises(
        CheckpointError, match=r"does not match the model: missing \[\], unexpected \['model.layers.2"
    ):
        build_models(cfg, device=CPU, dtype=torch.float32, checkpoint=str(tmp_path / "wide_ckpt"))


def test_lora_uses_the_base_as_the_reference(tmp_path, tiny_model_dir):
    cfg = _config(
        tmp_path, tiny_model_dir, kl={"placement": "loss", "beta": 0.04}, model={"lora": {"rank": 2}}
    )
    m = build_models(cfg, device=CPU, dtype=torch.float32, checkpoint=None)
    assert m.reference is None and m.policy_as_reference is not None
    trainable = [n for n, p in m.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_a_model_object_is_trained_in_place_and_its_start_is_the_reference(tmp_path):
    model, tokenizer = make_tiny_llama(seed=3)
    model.model.embed_tokens.requires_grad_(False)
    cfg = _config(tmp_path, "<model LlamaForCausalLM (in memory)>", kl={"placement": "loss", "beta": 0.04})
    m = build_models(
        cfg,
        device=CPU,
        dtype=torch.float32,
        checkpoint=None,
        model=model,
        tokenizer=tokenizer,
        run_dir=str(tmp_path),
    )
    assert m.policy is model and m.weights_differ_from_path
    assert all(p.requires_grad for p in model.parameters())  # every parameter trains
    assert m.reference is not model and _same_weights(m.reference, model)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # training the policy leaves the reference as it started
    assert not _same_weights(m.reference, model)
    # Without a folder of its own it is written for engines and critics that load from one.
    assert m.model_path == os.path.join(str(tmp_path), "start_model")
    assert os.path.isfile(os.path.join(m.model_path, "config.json"))
    assert m.tokenizer is not tokenizer  # a copy: the caller's tokenizer is not changed


def test_adopt_model_prepares_a_model_for_training(tmp_path):
    model, tokenizer = make_tiny_llama(seed=0, attention_dropout=0.5)
    tokenizer.padding_side = "right"
    model.eval()
    model.config.use_cache = True
    got, tok, folder = adopt_model(model, tokenizer, dtype=torch.bfloat16, run_dir=str(tmp_path))
    assert got.training and got.config.use_cache is False
    assert {p.dtype for p in got.parameters()} == {torch.bfloat16}
    assert got.config.attention_dropout == 0.0
    assert tok.padding_side == "left" and tokenizer.padding_side == "right"
    assert folder == os.path.join(str(tmp_path), "start_model")


def test_adopt_model_refusals(tmp_path):
    with pytest.raises(TypeError, match="model must be a transformers model"):
        adopt_model(torch.nn.Linear(2, 2), None, dtype=torch.float32, run_dir=str(tmp_path))
    model, tokenizer = make_tiny_llama(seed=0)
    with pytest.raises(ValueError, match="no local folder to read its tokenizer from; pass tokenizer="):
        adopt_model(model, None, dtype=torch.float32, run_dir=str(tmp_path))
    with pytest.raises(ValueError, match="give run_dir"):
        adopt_model(model, tokenizer, dtype=torch.float32, run_dir=None)


def test_adopt_model_reads_the_tokenizer_of_a_local_folder(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    got, tok, folder = adopt_model(model, None, dtype=torch.float32, run_dir=str(tmp_path))
    assert folder == tiny_model_dir and tok.eos_token_id == EOS_ID
    assert not (tmp_path / "start_model").exists()  # it has a folder: nothing written


def test_load_eval_models_is_frozen(tmp_path, tiny_model_dir):
    m = load_eval_models(_config(tmp_path, tiny_model_dir), device=CPU, dtype=torch.float32)
    assert not any(p.requires_grad for p in m.policy.parameters()) and m.reference is None
    assert m.model_path == tiny_model_dir and not m.weights_differ_from_path


def test_record_model_object(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = _config(tmp_path, ModelConfig().name)
    assert record_model_object(cfg, model).model.name == tiny_model_dir  # the default is replaced
    same = _config(tmp_path, tiny_model_dir + "/")  # the same folder spelled otherwise: kept
    assert record_model_object(same, model) is same
    with pytest.raises(ConfigError, match=f"set it to {tiny_model_dir!r}"):
        record_model_object(_config(tmp_path, "org/other"), model)
