"""The lab: instruments from the seeds, built on policygrad's own models and estimators.

- :mod:`~policygrad.lab.memory`: the memory bill of an RL job (``policygrad memory``).
- :mod:`~policygrad.lab.gradient_snr`: gradient signal-to-noise of advantage estimators
  (``policygrad lab gradient-snr``).
- :mod:`~policygrad.lab.kl_estimators`: k1/k2/k3 bias and spread, and which KL each placement's
  gradient follows (``policygrad lab kl-estimators``).
- :mod:`~policygrad.lab.mismatch`: sampler/trainer and bf16/fp32 log-prob mismatch
  (``policygrad lab mismatch``).
- :mod:`~policygrad.lab.report`: one HTML page about one or more runs (``policygrad report``).

Each command prints a table, writes a JSON result and a PNG plot under ``--output-dir``
(default ``lab-results/``), and has a Python entry point returning a dataclass. Submodules are
imported on use, so importing :mod:`policygrad.lab` loads neither transformers nor matplotlib.
"""

LAB_COMMANDS = {
    "gradient-snr": "policygrad.lab.gradient_snr",
    "kl-estimators": "policygrad.lab.kl_estimators",
    "mismatch": "policygrad.lab.mismatch",
}
"""``policygrad lab <name>`` -> the module whose ``main(argv)`` runs it."""

__all__ = ["LAB_COMMANDS"]
