"""The lab: small experiments that check claims of the RL-post-training literature on a real model,
built on policygrad's own models and estimators.

- :mod:`~policygrad.lab.memory`: the memory bill of an RL job (``policygrad memory``; the
  model-state accounting of Rajbhandari et al. 2019, ZeRO, section 3.1).
- :mod:`~policygrad.lab.gradient_snr`: gradient signal-to-noise of advantage estimators
  (``policygrad lab gradient-snr``; after Ilyas et al. 2018).
- :mod:`~policygrad.lab.kl_estimators`: k1/k2/k3 bias and spread (Schulman 2020), and which KL
  each placement's gradient follows (``policygrad lab kl-estimators``; Tang & Munos 2025,
  Shah et al. 2025).
- :mod:`~policygrad.lab.mismatch`: sampler/trainer and bf16/fp32 log-prob mismatch
  (``policygrad lab mismatch``; Yao et al. 2025, Qi et al. 2025).
- :mod:`~policygrad.lab.passk`: pass@k of a base and a trained model against k, does RL teach or
  select (``policygrad lab passk``; Yue et al. 2025); also writes an HTML page.
- :mod:`~policygrad.lab.report`: one HTML page about one or more runs (``policygrad report``).

Each command prints a table, writes a JSON result and a PNG plot under ``--output-dir``
(default ``lab-results/``), and has a Python entry point returning a dataclass. Submodules are
imported on use, so importing :mod:`policygrad.lab` loads neither transformers nor matplotlib.
"""

LAB_COMMANDS = {
    "gradient-snr": "policygrad.lab.gradient_snr",
    "kl-estimators": "policygrad.lab.kl_estimators",
    "mismatch": "policygrad.lab.mismatch",
    "passk": "policygrad.lab.passk",
}
"""``policygrad lab <name>`` -> the module whose ``main(argv)`` runs it."""

__all__ = ["LAB_COMMANDS"]
