"""Command-line plumbing shared by ``policygrad eval`` and the lab commands: an argument parser
whose mistakes are one ``error:`` line, and the sampling-temperature check a run applies."""

from __future__ import annotations

import argparse
import math

from policygrad.config.checks import MIN_TEMPERATURE

__all__ = ["OneLineArgumentParser", "check_temperature"]


class OneLineArgumentParser(argparse.ArgumentParser):
    """An argument parser whose mistakes (unknown option, bad type, bad choice) raise ValueError,
    which the CLI prints as one ``error:`` line, instead of argparse's usage block and exit.
    ``--help`` still prints the help and exits."""

    def error(self, message: str):
        raise ValueError(f"{self.prog}: {message} (see {self.prog} --help)")


def check_temperature(value: float, name: str = "--temperature") -> float:
    """A sampling temperature: finite and >= ``MIN_TEMPERATURE`` (1e-3), as a training run's.

    Raises:
        ValueError: names the option and the smallest allowed value.
    """
    if not (math.isfinite(value) and value >= MIN_TEMPERATURE):
        raise ValueError(f"{name} must be a finite number >= {MIN_TEMPERATURE}, got {value}")
    return value
