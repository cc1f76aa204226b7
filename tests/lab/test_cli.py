"""The lab's commands in ``policygrad``'s front door: help texts and the dispatch of ``lab``."""

from __future__ import annotations

import pytest

from policygrad.cli import COMMANDS, main
from policygrad.lab import LAB_COMMANDS

pytestmark = pytest.mark.integration


def test_commands_are_listed(capsys):
    assert {"memory", "lab", "report"} <= set(COMMANDS)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("memory", "lab", "report"):
        assert f"\n  {name} " in out


def test_lab_usage_lists_every_experiment(capsys):
    assert main(["lab"]) == 0
    out = capsys.readouterr().out
    for name in LAB_COMMANDS:
        assert name in out


def test_unknown_experiment_is_one_error_line(capsys):
    assert main(["lab", "mismatches"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: unknown lab experiment 'mismatches'; choose one of gradient-snr, kl-estimators, mismatch, "
        "passk\n"
    )
