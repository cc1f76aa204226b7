"""The names of the loss aggregation modes, without torch (:func:`policygrad.core.masking.aggregate`
implements them; the config checks ``loss.agg_mode`` against them).

Sources: GRPO (Shao et al. 2024, eq. 3) for ``seq-mean-token-mean``; DAPO (Yu et al. 2025,
section 3.3) for ``token-mean``; Dr.GRPO (Liu et al. 2025, section 3.1) for
``seq-mean-token-sum-norm``.
"""

from __future__ import annotations

__all__ = ["AGGREGATION_MODES"]

AGGREGATION_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
"""The reduction modes accepted by :func:`~policygrad.core.masking.aggregate`."""
