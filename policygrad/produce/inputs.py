"""The providers of the inputs advantage estimators declare, in one table.

An estimator registered with ``inputs=(...)``
(:func:`~policygrad.core.advantages.register_advantage_estimator`) receives each named input as a
keyword; :data:`ESTIMATOR_INPUTS` says who makes it, as an
:class:`~policygrad.produce.stages.EstimatorInput` (a sampling half the producer runs, a
finishing half on the trainer's thread). The table is built here, from the modules that
implement the providers, so importing a provider registers nothing as a side effect; a new
provider is one more entry (or :func:`register_estimator_input` for one outside the package).
"""

from __future__ import annotations

from collections.abc import Iterable

from policygrad.produce.stages import EstimatorInput, finish_greedy_baseline, sample_greedy_baseline
from policygrad.produce.vine import (
    finish_vine_segments,
    finish_vine_values,
    sample_vine,
    sample_vine_segments,
    vine_metrics,
)

__all__ = ["ESTIMATOR_INPUTS", "estimator_inputs", "register_estimator_input"]

ESTIMATOR_INPUTS: dict[str, EstimatorInput] = {
    # float32 [B]: ReMax's baseline, the score of one greedy response to each row's prompt.
    "baseline_rewards": EstimatorInput(sample_greedy_baseline, finish_greedy_baseline),
    # float32 [B, T]: VinePPO's Monte-Carlo value of each token's segment, and the segments.
    "vine_values": EstimatorInput(sample_vine, finish_vine_values, vine_metrics),
    "vine_segments": EstimatorInput(sample_vine_segments, finish_vine_segments),
}


def register_estimator_input(name: str, provider: EstimatorInput) -> EstimatorInput:
    """Add the provider of estimator input ``name`` to :data:`ESTIMATOR_INPUTS`.

    Raises:
        ValueError: ``name`` already has a provider.
    """
    if name in ESTIMATOR_INPUTS:
        raise ValueError(f"estimator input {name!r} already has a provider")
    ESTIMATOR_INPUTS[name] = provider
    return provider


def estimator_inputs(names: Iterable[str]) -> dict[str, EstimatorInput]:
    """``{name: provider}`` of the inputs an estimator declares (``spec.inputs``), in its order.

    Raises:
        KeyError: an input without a provider (names it and the known ones).
    """
    out = {}
    for name in names:
        if name not in ESTIMATOR_INPUTS:
            raise KeyError(
                f"estimator input {name!r} has no provider; known: {', '.join(sorted(ESTIMATOR_INPUTS))}"
            )
        out[name] = ESTIMATOR_INPUTS[name]
    return out
