"""Tests of policygrad.config.reference and the command's use of it: ``policygrad train --help``
lists every leaf of the config tree with its default, and ``--print-config`` prints a config that
loads back to the same one."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from policygrad.cli import main
from policygrad.config.reference import option_rows
from policygrad.config.train import TrainConfig, load_config

pytestmark = pytest.mark.unit


def leaves(obj, prefix=""):
    """Every leaf of a config instance, walked independently of option_rows (through the values)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(leaves(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def test_help_lists_every_leaf_of_the_config_with_its_default(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    every = leaves(TrainConfig())
    assert len(every) > 150
    for name in every:
        assert f"  --{name}=" in out, name
    assert "  --agent.timeout_s=120.0 " in out and "  --rollout.engine=auto " in out
    # option_rows is the same walk: names, in declaration order, and defaults of a fresh config
    # (reward.functions' default is decided at construction: null in the dataclass)
    rows = {name: default for name, _, default in option_rows(TrainConfig)}
    assert list(rows) == list(every)
    assert {k: v for k, v in rows.items() if k != "reward.functions"} == {
        k: v for k, v in every.items() if k != "reward.functions"
    }


def test_print_config_prints_a_file_that_loads_to_the_same_config(tmp_path, capsys):
    argv = ["configs/rloo.yaml", "--kl.beta=0.02", "--steps=7", f"--output_dir={tmp_path / 'run'}"]
    assert main(["train", "--print-config", *argv]) == 0
    out = capsys.readouterr().out
    path = tmp_path / "printed.yaml"
    path.write_text(out)
    assert load_config(str(path)).to_dict() == load_config(argv[0], argv[1:]).to_dict()
    assert yaml.safe_load(out)["kl"]["beta"] == 0.02
    assert not (tmp_path / "run").exists()  # nothing was started


def test_print_config_refuses_a_bad_option_as_a_run_would(capsys):
    assert main(["train", "--print-config", "--kl.bta=1"]) == 2
    assert "error: " in capsys.readouterr().err
