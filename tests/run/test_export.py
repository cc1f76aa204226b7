"""Model folders a run hands out, without a model run: the card's metrics (the last value of
each, up to a step), the card's text, the untying of a tied pair an adapter trained apart, and the
clean-up of exports killed part-way. Writing a merged export end to end (LoRA folded into plain
weights that load anywhere) is tested in tests/trainer/test_adapters.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from policygrad import __version__
from policygrad.config.train import load_config
from policygrad.run import export
from policygrad.run.export import (
    CARD_METRICS,
    final_metrics,
    model_card,
    remove_dead_exports,
    untie_trained_copies,
    write_model_card,
)
from tests.tiny import make_tiny_llama


def write_rows(run_dir, *rows, tail=""):
    with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + tail)


# ----------------------------------------------------------------------------- final metrics


@pytest.mark.unit
def test_final_metrics_are_the_last_numeric_value_of_each(tmp_path):
    write_rows(
        tmp_path,
        {"step": 1, "reward/mean": 0.1, "kl/ref": 0.01, "eval/accuracy": 0.2, "other": 5.0},
        {"step": 2, "reward/mean": 0.3, "kl/ref": None, "policy/entropy": "n/a"},
        {"step": 3, "reward/mean": 0.4, "response/length_mean": 12},
        tail='{"step": 4, "reward/mean": 0.9',  # a torn last line: skipped
    )
    assert final_metrics(str(tmp_path)) == {
        "reward/mean": 0.4,
        "kl/ref": 0.01,  # the null of step 2 is no value: step 1's stays
        "eval/accuracy": 0.2,
        "response/length_mean": 12.0,
    }
    assert set(final_metrics(str(tmp_path))) <= set(CARD_METRICS)  # "other" is not quoted


@pytest.mark.unit
def test_final_metrics_stop_at_the_checkpoints_step(tmp_path):
    write_rows(
        tmp_path,
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.2},
        {"step": 3, "reward/mean": 0.3},
    )
    assert final_metrics(str(tmp_path), up_to_step=2) == {"reward/mean": 0.2}
    assert final_metrics(str(tmp_path), up_to_step=0) == {}


@pytest.mark.unit
def test_final_metrics_without_a_file_are_empty(tmp_path):
    assert final_metrics(str(tmp_path)) == {}


# ----------------------------------------------------------------------------- the card


def run_config(**over):
    base = {
        "output_dir": "/runs/gsm8k-grpo",
        "algorithm": "grpo",
        "seed": 7,
        "model": {"name": "org/base"},
        "data": {"dataset": "gsm8k.jsonl"},
        "rollout": {"prompts_per_step": 4, "group_size": 8, "temperature": 0.7, "max_new_tokens": 64},
        "optim": {"lr": 1e-5},
        "kl": {"placement": "loss", "beta": 0.04},
    }
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(None, base).to_dict()


@pytest.mark.unit
def test_the_card_of_a_full_model():
    card = model_card(
        run_config(), steps=12, metrics={"reward/mean": 0.123456, "kl/ref": 2.5e-5}, kind="full model"
    )
    lines = card.splitlines()
    assert lines[:7] == [
        "---",
        "library_name: transformers",
        "tags:",
        "- policygrad",
        "- reinforcement-learning",
        "- grpo",
        "---",
    ]
    assert "# gsm8k-grpo" in lines  # no run_name: the output folder's name
    trained = f"A full model trained with policygrad {__version__}"
    assert f"{trained} (reinforcement learning from verifiable rewards)." in lines
    for row in [
        "| base model | `org/base` |",
        "| algorithm | `grpo` |",
        "| samples | 4 prompts x 8 samples per step, temperature 0.7, at most 64 new tokens |",
        "| KL to the reference | loss, beta 0.04 |",
        "| data | `gsm8k.jsonl` |",
        "| steps | 12 |",
        "| seed | 7 |",
        "| `reward/mean` | 0.1235 |",  # 4 significant digits
        "| `kl/ref` | 2.5e-05 |",
        "model = AutoModelForCausalLM.from_pretrained(PATH)",
    ]:
        assert row in lines, row
    assert not any(line.startswith(("| LoRA", "| started from adapter")) for line in lines)
    # The whole config closes the card, as YAML that reads back to the same values.
    import yaml

    body = card.split("```yaml\n", 1)[1].rsplit("\n```", 1)[0]
    assert yaml.safe_load(body) == yaml.safe_load(yaml.safe_dump(run_config()))


@pytest.mark.unit
def test_the_card_of_an_adapter_names_peft_lora_and_the_starting_adapter():
    config = run_config(model={"lora": {"rank": 4, "alpha": 8.0}}, run_name="mine", kl={"placement": "none"})
    config["model"]["adapter"] = "/adapters/start"  # as a run started from an adapter records it
    lines = model_card(
        config, steps=3, metrics={}, kind="LoRA adapter", base_model="/models/base"
    ).splitlines()
    assert "library_name: peft" in lines and "# mine" in lines
    assert "| base model | `/models/base` |" in lines  # base_model wins over model.name
    assert "| started from adapter | `/adapters/start` |" in lines
    assert any(line.startswith("| LoRA | rank 4, alpha 8.0, targets ") for line in lines)
    assert "| KL to the reference | none |" in lines  # no beta without a KL term
    assert "model = AutoPeftModelForCausalLM.from_pretrained(PATH)" in lines
    assert "## Final metrics" not in lines  # no metrics: no section


@pytest.mark.unit
def test_the_card_names_the_dataset_config_and_the_eval_set():
    config = run_config(data={"dataset_config": "main", "eval_dataset": "test.jsonl"})
    assert (
        "| data | `gsm8k.jsonl` (main), evaluated on `test.jsonl` |"
        in model_card(config, steps=1, metrics={}, kind="full model").splitlines()
    )


@pytest.mark.unit
def test_the_title_of_an_output_dir_given_with_a_trailing_slash():
    lines = model_card(run_config(output_dir="/runs/gsm8k-grpo/"), steps=1, metrics={}, kind="full model")
    assert "# gsm8k-grpo" in lines.splitlines()


@pytest.mark.unit
def test_write_model_card_replaces_readme(tmp_path):
    (tmp_path / "README.md").write_text("peft's template")
    write_model_card(str(tmp_path), "# card\n")
    assert (tmp_path / "README.md").read_text() == "# card\n"


# ----------------------------------------------------------------------------- tied weights


@pytest.fixture
def tied_folder(tmp_path):
    model, _ = make_tiny_llama()
    model.config.save_pretrained(tmp_path)
    return model, tmp_path


@pytest.mark.integration
def test_an_untrained_tied_pair_stays_tied(tied_folder):
    model, folder = tied_folder
    before = (folder / "config.json").read_text()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert untie_trained_copies(str(folder), model, state) is False
    assert (folder / "config.json").read_text() == before


@pytest.mark.integration
def test_a_tied_pair_trained_apart_is_untied_in_the_saved_config(tied_folder):
    model, folder = tied_folder
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] + 1e-3  # a head trained on its own
    assert untie_trained_copies(str(folder), model, state) is True
    saved = json.loads((folder / "config.json").read_text())
    assert saved["tie_word_embeddings"] is False
    assert saved["hidden_size"] == 32  # the rest of the config is kept


# ----------------------------------------------------------------------------- killed exports


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.unit
def test_only_the_folders_of_dead_exports_of_that_name_are_deleted(tmp_path):
    dead = dead_pid()
    for name in [
        f"merged_model.tmp-{dead}",  # its process is gone: deleted
        f"merged_model.tmp-{os.getpid()}",  # this process's own: left
        f"merged_model.tmp-{os.getppid()}",  # a live process's: left
        "merged_model.tmp-notes",  # not a pid: left
        f"other.tmp-{dead}",  # another folder's: left
        "merged_model",
    ]:
        (tmp_path / name).mkdir()
    removed = remove_dead_exports(str(tmp_path / "merged_model"))
    assert removed == [str(tmp_path / f"merged_model.tmp-{dead}")]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [
            "merged_model",
            f"merged_model.tmp-{os.getpid()}",
            f"merged_model.tmp-{os.getppid()}",
            "merged_model.tmp-notes",
            f"other.tmp-{dead}",
        ]
    )


@pytest.mark.unit
def test_no_parent_folder_is_nothing_to_remove(tmp_path):
    assert remove_dead_exports(str(tmp_path / "missing" / "merged_model")) == []


@pytest.mark.unit
def test_alive(monkeypatch):
    assert export._alive(os.getpid()) is True
    assert export._alive(dead_pid()) is False

    def not_ours(_pid, _sig):
        raise PermissionError

    monkeypatch.setattr(export.os, "kill", not_ours)
    assert export._alive(1) is True  # another user's process is alive


@pytest.mark.integration
def test_export_merged_of_a_plain_model_matches_its_weights(tmp_path):
    from safetensors.torch import load_file

    from tests.tiny import make_tiny_tokenizer

    model, _ = make_tiny_llama(seed=3)
    folder = export.export_merged(model, make_tiny_tokenizer(), str(tmp_path / "out"), card="# c\n")
    assert folder == str(tmp_path / "out")
    assert (tmp_path / "out" / "README.md").read_text() == "# c\n"
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    assert os.listdir(tmp_path) == ["out"]  # the temporary folder was renamed into place
