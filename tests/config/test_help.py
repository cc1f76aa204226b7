"""The one-line help of every option (policygrad.config.help): one line per leaf of the config
tree, no more, no less, so an option cannot be added, renamed or removed without its line."""

from __future__ import annotations

import pytest

from policygrad.config.help import OPTION_HELP
from policygrad.config.reference import option_rows, options_text
from policygrad.config.train import TrainConfig

pytestmark = pytest.mark.unit


def test_every_option_has_its_line_and_every_line_an_option():
    leaves = [name for name, _, _ in option_rows(TrainConfig)]
    assert sorted(OPTION_HELP) == sorted(leaves)
    assert all(0 < len(text) <= 110 and "\n" not in text for text in OPTION_HELP.values())


def test_the_help_prints_each_options_line_beside_it():
    lines = options_text(TrainConfig).splitlines()
    for name, text in OPTION_HELP.items():
        line = next(line for line in lines if line.strip().startswith(f"--{name}="))
        assert line.endswith(text), (name, line)
