"""The command-line plumbing shared by ``policygrad eval`` and the lab: one-line argument errors
and the sampling-temperature check."""

from __future__ import annotations

import pytest

from policygrad.arguments import OneLineArgumentParser, check_temperature

unit = pytest.mark.unit


@unit
def test_argument_mistakes_are_one_value_error_line():
    parser = OneLineArgumentParser(prog="policygrad lab kl-estimators")
    parser.add_argument("--samples", type=int)
    with pytest.raises(ValueError) as caught:
        parser.parse_args(["--samples", "many"])
    message = str(caught.value)
    assert message.startswith("policygrad lab kl-estimators: argument --samples: invalid int value: 'many'")
    assert message.endswith("(see policygrad lab kl-estimators --help)") and "\n" not in message
    with pytest.raises(ValueError, match="unrecognized arguments: --nope"):
        parser.parse_args(["--nope", "3"])


@unit
def test_help_still_prints_and_exits(capsys):
    parser = OneLineArgumentParser(prog="lab")
    with pytest.raises(SystemExit) as caught:
        parser.parse_args(["--help"])
    assert caught.value.code == 0 and "usage: lab" in capsys.readouterr().out


@unit
def test_check_temperature():
    assert check_temperature(1e-3) == 1e-3 and check_temperature(0.7) == 0.7
    for bad in (0.0, 9e-4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^--temperature must be a finite number >= 0.001, got"):
            check_temperature(bad)
    with pytest.raises(ValueError, match="^--eval-temperature must"):
        check_temperature(0.0, "--eval-temperature")
