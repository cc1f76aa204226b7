"""Tests of ``policygrad memory``: a shape from the command line's numbers, the JSON and PNG it
writes, the CLI and its one-line errors (the bill itself: test_memory_bill.py, test_memory_plan.py;
the model's shape and activations: tests/parallel/test_footprint.py)."""

from __future__ import annotations

import json

import pytest

from policygrad.cli import main
from policygrad.lab.memory import parse_count, resolve_shape, run_memory
from policygrad.lab.memory_plan import check_options

pytestmark = pytest.mark.integration


def seven_b(**kw):
    return resolve_shape(params=7e9, **kw)


def test_kv_cache_without_gqa_from_hidden():
    # --hidden 4096 --layers 32 and no KV heads: K and V are 4096 wide.
    shape = seven_b(hidden=4096, layers=32)
    assert shape.kv_cache_bytes(1, 1) == 2 * 32 * 4096 * 2


def test_parse_count():
    assert parse_count("7e9", "--params") == 7_000_000_000
    assert parse_count("7B", "--params") == 7_000_000_000
    assert parse_count("135M", "--params") == 135_000_000
    assert parse_count("128k", "--vocab") == 128_000
    with pytest.raises(ValueError, match="--params"):
        parse_count("seven", "--params")
    with pytest.raises(ValueError, match="positive"):
        parse_count("-1", "--params")


def test_run_memory_writes_json_and_png(tmp_path):
    plan = run_memory(seven_b(vocab=128_000), "ppo", output_dir=str(tmp_path), batch=256, seq_len=4096)
    with open(plan.json_path) as f:
        data = json.load(f)
    assert data["plan"]["state_bytes"] == 252_000_000_000
    assert [p["algorithm"] for p in data["compared"]] == ["sft", "grpo"]
    with open(plan.png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_memory(tmp_path, capsys):
    argv = [
        "memory",
        "--params",
        "7e9",
        "--vocab",
        "128000",
        "--batch",
        "256",
        "--seq-len",
        "4096",
        "--algorithm",
        "ppo",
        "--output-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "268.4" in out  # the logits row
    assert "112.0" in out  # policy and critic rows
    assert "2.25x SFT" in out
    assert str(tmp_path / "memory.png") in out


def test_cli_memory_errors(capsys):
    assert main(["memory", "--params", "7e9", "--algorithm", "dpo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown algorithm 'dpo'; choose one of")
    assert main(["memory", "--model", "/no/such/folder"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_fsdp_with_lora_is_refused_as_train_refuses_it(capsys):
    # Before: priced, though train refuses the combination; both say it in the same words.
    from policygrad.errors import fsdp_lora_refusal

    argv = ["--params", "7e9", "--world-size", "2", "--strategy", "fsdp", "--lora-rank", "8"]
    assert main(["memory", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --strategy=fsdp shards full fine-tuning; a LoRA run (--lora-rank) trains a small adapter "
        "that every rank can hold: set --strategy ddp"
    ]
    shared = fsdp_lora_refusal(strategy="--strategy", lora="--lora-rank", ddp="--strategy ddp")
    assert err[0] == f"error: {shared}"
    # One process trains without a strategy (train ignores it there), so the bill is priced.
    check_options("grpo", lora_rank=8, world_size=1, strategy="fsdp")


@pytest.mark.parametrize("args", [["--world-size", "2.5"], ["--strategy", "zero"], ["--world-size", "0"]])
def test_bad_memory_arguments_are_one_error_line(args, capsys):
    assert main(["memory", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "--world-size" in err[0] or "--strategy" in err[0]


def test_cli_memory_config_plans_a_training_run(tiny_model_dir, capsys, monkeypatch):
    # the same arguments as policygrad train: a config (here none) and --key=value overrides
    args = [f"--model.name={tiny_model_dir}", "--rollout.engine=hf", "--model.precision=fp32"]
    assert main(["memory", "--config", *args, "--optim.micro_batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert "planned peak of the trainer process: hf engine, fp32" in out
    assert "micro-batch of 4 sequences" in out and "fits:" in out
    # a machine with too little memory: the plan says train would refuse it, and why
    monkeypatch.setattr("policygrad.parallel.before_loading.available_memory_bytes", lambda: 10**8)
    monkeypatch.setattr("policygrad.parallel.before_loading._resident_bytes", lambda: 0)
    assert main(["memory", "--config", *args]) == 0
    assert "does not fit; policygrad train refuses it: this run is planned to need at least" in (
        capsys.readouterr().out
    )
    # a bad override is the config's own one-line error
    assert main(["memory", "--config", "--optim.micro_batch_sise=4"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown config key optim.micro_batch_sise")
