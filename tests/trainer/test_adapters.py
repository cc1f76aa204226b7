"""LoRA in and out: a run started from a trained adapter (``model.adapter``, or the adapter folder
as ``model.name``) trains that adapter against the starting policy as its reference; a LoRA
checkpoint's ``model/`` folder trains and evaluates as ``--model``; a merged export and every
model folder carry a model card."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from policygrad.cli import main
from policygrad.models.adapters import load_model, resolve_model_source
from policygrad.models.forward import inference_logprobs
from policygrad.models.loading import apply_lora, load_causal_lm
from policygrad.run import Run
from tests.training import write_jsonl

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory, eos_model_dir) -> str:
    """A LoRA adapter on the tiny model whose B matrices are not zero (a "trained" adapter:
    base + adapter differs from the base)."""
    folder = tmp_path_factory.mktemp("adapter")
    model = apply_lora(load_causal_lm(eos_model_dir), rank=4, alpha=8.0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    model.save_pretrained(folder)
    return str(folder)


def _kl_run(make_config, run, **model):
    # Two epochs: the old log-probs are recomputed by the trainer, so kl/ref compares two
    # forwards of the same weights (the sampler's KV-cache decode would differ by rounding).
    return make_config(
        run,
        steps=1,
        model=model,
        kl={"placement": "loss", "beta": 0.1},
        optim={"lr": 1e-2, "micro_batch_size": 8, "ppo_epochs": 2},
    )


@pytest.mark.parametrize("form", ["adapter_field", "adapter_as_name"])
def test_a_run_from_a_trained_adapter_starts_at_kl_zero_with_the_adapter_logprobs(
    form, make_config, eos_model_dir, trained_adapter
):
    if form == "adapter_field":
        cfg = _kl_run(make_config, form, name=eos_model_dir, adapter=trained_adapter)
    else:
        cfg = _kl_run(make_config, form, name=trained_adapter)
    run = Run(cfg)
    seen = {}
    reference, old = run.trainer.reference_logprobs, run.trainer.old_logprobs
    run.trainer.reference_logprobs = lambda r: seen.setdefault("ref", (r, reference(r)))[1]
    run.trainer.old_logprobs = lambda r: seen.setdefault("old", old(r))
    try:
        metrics = run.trainer.step()
    finally:
        run.close()
    assert metrics["kl/ref"] == 0.0
    rollout, ref = seen["ref"]
    assert torch.equal(ref, seen["old"])
    # The same log-probs as the adapter model loaded on its own, and not the base model's.
    source = resolve_model_source(eos_model_dir, trained_adapter)
    adapter_model = load_model(source, trainable=False)
    kwargs = {"temperature": cfg.rollout.temperature, "micro_batch_size": 8}
    expected = inference_logprobs(adapter_model, rollout, **kwargs)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(ref[mask], expected[mask], rtol=0, atol=1e-5)
    base = inference_logprobs(load_causal_lm(eos_model_dir, trainable=False), rollout, **kwargs)
    assert (base[mask] - expected[mask]).abs().max() > 1e-2
    # The adapter trained: its weights moved, and the reference (the starting adapter) did not.
    assert metrics["optim/steps"] >= 1


def test_a_lora_checkpoint_trains_evaluates_and_exports_with_model_cards(
    make_config, tmp_path, capsys, eos_model_dir
):
    cfg = make_config(
        "lora",
        steps=1,
        reward_fn="length_fraction",
        model={"lora": {"rank": 4, "alpha": 8.0}},
        export_merged=True,
    )
    run = Run(cfg)
    try:
        summary = run.train()
        policy = run.trainer.policy
    finally:
        run.close()
    folder = tmp_path / "lora" / "checkpoints" / "step_1" / "model"
    assert (folder / "adapter_config.json").exists() and not (folder / "config.json").exists()
    card = (folder / "README.md").read_text()
    for text in ("LoRA adapter", eos_model_dir, "`grpo`", "| steps | 1 |", "reward/mean", "policygrad 0."):
        assert text in card, text

    # The merged export: a plain model folder computing what the LoRA policy computes.
    merged = summary["merged_model"]
    assert "merged model" in open(os.path.join(merged, "README.md")).read()
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, policy(input_ids=ids).logits, rtol=1e-4, atol=1e-4)

    # The checkpoint's model/ folder evaluates as --model (base from its adapter_config.json)...
    rows = [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    capsys.readouterr()
    argv = [
        "eval",
        "--model",
        str(folder),
        "--dataset",
        data,
        "--max-new-tokens",
        "4",
        "--engine",
        "hf",
        "--output",
        str(tmp_path / "e.jsonl"),
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 2
    # ... and trains as model.name: the run starts from the adapter and keeps training it.
    again = Run(make_config("again", steps=1, reward_fn="length_fraction", model={"name": str(folder)}))
    try:
        again.train()
    finally:
        again.close()
    assert (tmp_path / "again" / "checkpoints" / "step_1" / "model" / "adapter_config.json").exists()


def test_a_full_model_checkpoint_carries_a_model_card(make_config, tmp_path):
    run = Run(make_config("full", steps=1, reward_fn="length_fraction"))
    try:
        run.train()
    finally:
        run.close()
    card = (tmp_path / "full" / "checkpoints" / "step_1" / "model" / "README.md").read_text()
    assert "full model" in card and "| steps | 1 |" in card and "## Final metrics" in card


def test_adapter_mistakes_are_one_line_errors(make_config, eos_model_dir, trained_adapter, tmp_path):
    from policygrad.config.train import ConfigError

    with pytest.raises(ConfigError, match="model.adapter with model.lora.rank=4"):
        make_config("x", model={"adapter": trained_adapter, "lora": {"rank": 4}})
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        resolve_model_source(eos_model_dir, str(tmp_path))
    with pytest.raises(ValueError, match="is an adapter folder and model.adapter"):
        resolve_model_source(trained_adapter, trained_adapter)


@pytest.mark.parametrize("trained", [[], ["lm_head"], ["embed_tokens"], ["lm_head", "embed_tokens"]])
def test_a_merged_export_keeps_modules_the_adapter_trains_whole(eos_model_dir, tmp_path, trained):
    """A LoRA adapter that also trains whole modules (peft's modules_to_save) exports them: the
    merged folder computes the live policy's logits (before, lm_head.weight was missing and the
    tied model loaded its embedding as the head: logits off by up to 15.6 on the bundled model)."""
    from peft import LoraConfig, get_peft_model

    from policygrad.run.export import export_merged
    from tests.tiny import make_tiny_tokenizer

    base = load_causal_lm(eos_model_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=trained or None)
    policy = get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a "trained" adapter and trained copies of the whole modules
        for name, p in policy.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.5)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        live = policy(ids).logits
    folder = export_merged(policy, make_tiny_tokenizer(), str(tmp_path / "merged"))
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
    # Float rounding only: W + (alpha/r) B A in one matrix rounds apart from W x + (alpha/r) B (A x)
    # by ~1e-6 relative per product, ~1e-5 of the largest logit over these sums.
    assert (exported - live).abs().max() <= 1e-5 * live.abs().max()
    # Loaders that tie a tied model's head to its embedding (vLLM) see a separate head.
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["tie_word_embeddings"] is (not trained)


def test_an_export_deletes_what_a_killed_export_left(eos_model_dir, tmp_path):
    import subprocess

    from policygrad.run.export import export_merged
    from tests.tiny import make_tiny_tokenizer

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    stale = tmp_path / f"merged_model.tmp-{dead.pid}"
    (stale / "model.safetensors").parent.mkdir()
    (stale / "model.safetensors").write_text("half")
    live = tmp_path / f"merged_model.tmp-{os.getppid()}"  # a running process's: not ours to delete
    live.mkdir()
    (tmp_path / "merged_model.tmp-notes").mkdir()  # not an export's name
    export_merged(load_causal_lm(eos_model_dir), make_tiny_tokenizer(), str(tmp_path / "merged_model"))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["merged_model", live.name, "merged_model.tmp-notes"])
